"""Cross entropy with soft targets: `target_tokens` and `weights` of shape [T, K]
(docs/semantics.md §1), the top-K distillation loss of tinker-cookbook's SDFT.

`L = Σ_t Σ_k −w_tk · lp_tk`, with `lp_tk = log softmax(logits_t)[target_tk]`, checked three
ways on the tiny models (LoRA with a non-zero B, and full weights):

- against the formula written here, on a plain transformers forward of the same weights
  (value, per-token logprobs and every gradient);
- K = 1 against the 1-D call: the same loss, outputs and gradients, bit for bit;
- K columns against the sum of K 1-D calls, one per column.

A merged pass (a soft-target session beside a 1-D PPO session) equals the solo calls, and bad
shapes are refused with the field named.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.engine.helpers import grads_of, make_resource, random_batch, sample
from tests.engine.test_merge import MERGING, PPO, SOLO, _compare, _concurrent, _solo, _step
from trainer.contract.errors import OperationError
from trainer.contract.specs import LoraConfig, LossConfig, Sample, SessionSpec, TensorData

CE = LossConfig(type="cross_entropy")
VOCAB = 128
RTOL = 2e-6  # fp32 on the CPU: summation order only


def soft_sample(tokens: list[int], targets: torch.Tensor, weights: torch.Tensor) -> Sample:
    """A sample with [T, K] targets and weights, sent as flat data and a shape."""
    shape = list(targets.shape)
    base = sample(tokens, targets[:, 0].tolist())
    base.loss_fn_inputs = {
        "target_tokens": TensorData(data=targets.reshape(-1).tolist(), dtype="int64", shape=shape),
        "weights": TensorData(data=weights.reshape(-1).tolist(), dtype="float32", shape=shape),
    }
    return base


Table = tuple[list[int], torch.Tensor, torch.Tensor]  # tokens, targets [T, K], weights [T, K]


def tables(seed: int, k: int, n: int = 3) -> list[Table]:
    """Random samples with K targets per position: distinct ids except one repeated pair (its
    gradient is the sum of both), softmax-like weights, and one position whose weights are all
    0 (masked) in every sample."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for s in random_batch(seed, n=n, lengths=(4, 9)):
        tokens = s.model_input.tokens
        t = len(tokens)
        targets = torch.stack([torch.randperm(VOCAB, generator=gen)[:k] for _ in range(t)])
        if k > 1:
            targets[1, 1] = targets[1, 0]
        weights = torch.rand(t, k, generator=gen).softmax(-1)
        weights[2] = 0.0
        out.append((tokens, targets, weights))
    return out


def _session(resource: Any, name: str, lora: bool = True) -> Any:
    spec = SessionSpec(lora_config=LoraConfig(rank=4, alpha=8, seed=7)) if lora else SessionSpec()
    session = resource.create_session(name, spec)
    with torch.no_grad():  # a non-zero B, so that every LoRA factor gets a gradient
        gen = torch.Generator().manual_seed(1)
        for key, param in session.policy.trainable.items():
            if "lora_B" in key:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return session


def reference(session: Any, data: list[Table]) -> tuple[float, list[torch.Tensor], dict]:
    """The formula on a plain transformers forward of the session's own weights: (L, each
    sample's [T, K] logprobs, the gradient of L for every trainable tensor)."""
    trainable = session.policy.trainable
    for param in trainable.values():
        param.grad = None
    with session.policy.training(train=False):
        total = torch.zeros(())
        lps = []
        for tokens, targets, weights in data:
            logits = session.policy.model(input_ids=torch.tensor([tokens])).logits[0].float()
            lp_T_K = torch.log_softmax(logits, dim=-1).gather(-1, targets)
            total = total - (weights * lp_T_K).sum()
            lps.append(lp_T_K.detach())
        total.backward()
    grads = {name: param.grad.detach().clone() for name, param in trainable.items()}
    for param in trainable.values():
        param.grad = None
    return float(total.detach()), lps, grads


def _outputs(result: dict[str, Any]) -> list[torch.Tensor]:
    out = []
    for o in result["loss_fn_outputs"]:
        t = o["tensors"]["logprobs"]
        out.append(torch.tensor(t["data"]).reshape(t.get("shape") or [-1]))
    return out


def _close(got: torch.Tensor, want: torch.Tensor, where: str, rtol: float = RTOL) -> None:
    err, scale = float((got - want).double().norm()), float(want.double().norm())
    assert err <= rtol * max(scale, 1e-12), f"{where}: ‖diff‖ {err:.3g} vs ‖want‖ {scale:.3g}"


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_value_logprobs_and_gradients_match_the_formula(tiny_model_dir, tmp_path, lora) -> None:
    resource = make_resource(tiny_model_dir, tmp_path, lora=lora, generator=False)
    session = _session(resource, "s", lora)
    data = tables(3, k=5)
    samples = [soft_sample(*d) for d in data]
    result = session.forward_backward(CE, samples, return_loss_fn_outputs=True)
    got_grads = grads_of(session)
    loss, lps, grads = reference(session, data)
    assert result["loss"] == pytest.approx(loss, rel=RTOL)
    # one masked position per sample; loss/tokens counts positions, not targets
    assert result["metrics"]["loss/tokens"] == sum(len(t) - 1 for t, _, _ in data)
    kept = torch.cat([lp[w != 0] for lp, (_, _, w) in zip(lps, data, strict=True)])
    assert result["metrics"]["loss/logprob/mean"] == pytest.approx(float(kept.mean()), rel=1e-5)
    for i, (out, lp) in enumerate(zip(_outputs(result), lps, strict=True)):
        assert out.shape == lp.shape, i
        want = lp.clone()
        want[2] = 0.0  # a masked position's row is 0 (docs/semantics.md §4)
        _close(out, want, f"outputs[{i}]")
    assert got_grads.keys() == grads.keys()
    for name, grad in grads.items():
        assert got_grads[name] is not None and float(grad.norm()) > 0, name
        _close(got_grads[name], grad, name, rtol=1e-5)


def test_every_position_with_logprobs_unmasked(tiny_qwen_dir, tmp_path) -> None:
    """The Tinker face's flag: outputs hold lp_tk at masked positions too; the loss is the
    same."""
    resource = make_resource(tiny_qwen_dir, tmp_path, generator=False)
    session = _session(resource, "s")
    data = tables(4, k=3)
    samples = [soft_sample(*d) for d in data]
    masked = session.forward_backward(CE, samples, forward_only=True, return_loss_fn_outputs=True)
    unmasked = session.forward_backward(
        CE, samples, forward_only=True, return_loss_fn_outputs=True, logprobs_unmasked=True
    )
    loss, lps, _ = reference(session, data)
    assert masked["loss"] == pytest.approx(loss, rel=RTOL)
    assert unmasked["loss"] == pytest.approx(loss, rel=RTOL)  # also sums the 0-weight rows
    for i, (out, lp) in enumerate(zip(_outputs(unmasked), lps, strict=True)):
        _close(out, lp, f"outputs[{i}]")
    assert "loss/entropy/mean" in unmasked["metrics"]


def _one_d(data: list[Table], column: int) -> list[Sample]:
    return [
        sample(tokens, targets[:, column].tolist(), weights=weights[:, column].tolist())
        for tokens, targets, weights in data
    ]


def _call(resource: Any, name: str, samples: list[Sample]) -> tuple[dict, dict]:
    session = _session(resource, name)
    result = session.forward_backward(
        CE, samples, return_loss_fn_outputs=True, logprobs_unmasked=True
    )
    return result, grads_of(session)


def test_one_column_is_the_1d_call_bit_for_bit(tiny_qwen_dir, tmp_path) -> None:
    resource = make_resource(tiny_qwen_dir, tmp_path, generator=False)
    data = tables(5, k=1)
    flat, flat_grads = _call(resource, "a", _one_d(data, 0))
    soft, soft_grads = _call(resource, "b", [soft_sample(*d) for d in data])
    assert soft["loss"] == flat["loss"]
    assert soft["metrics"] == flat["metrics"]
    for got, want in zip(_outputs(soft), _outputs(flat), strict=True):
        assert got.shape == (want.shape[0], 1)
        assert torch.equal(got[:, 0], want)
    for name, grad in flat_grads.items():
        assert torch.equal(soft_grads[name], grad), name


def test_k_columns_are_the_sum_of_k_1d_calls(tiny_qwen_dir, tmp_path) -> None:
    resource = make_resource(tiny_qwen_dir, tmp_path, generator=False)
    k = 4
    data = tables(6, k=k)
    soft, soft_grads = _call(resource, "soft", [soft_sample(*d) for d in data])
    columns = [_call(resource, f"c{j}", _one_d(data, j)) for j in range(k)]
    assert soft["loss"] == pytest.approx(sum(r["loss"] for r, _ in columns), rel=RTOL)
    for i, got in enumerate(_outputs(soft)):
        for j, (result, _) in enumerate(columns):
            assert torch.equal(got[:, j], _outputs(result)[i]), (i, j)
    for name in soft_grads:
        total = sum(grads[name] for _, grads in columns)
        _close(soft_grads[name], total, name)


def _soft_call(seed: int, forward_only: bool = False) -> Any:
    def op(session: Any) -> dict[str, Any]:
        samples = [soft_sample(*d) for d in tables(seed, k=3, n=4)]
        out = session.forward_backward(
            CE, samples, forward_only=forward_only, return_loss_fn_outputs=True
        )
        return {"result": out, "grads": grads_of(session)}

    return op


def _ppo_call(seed: int) -> Any:
    def op(session: Any) -> dict[str, Any]:
        samples = random_batch(seed, n=4, logprobs="logprobs", advantages="x")
        out = session.forward_backward(PPO, samples, return_loss_fn_outputs=True)
        return {"result": out, "grads": grads_of(session)}

    return op


def test_a_merged_pass_equals_solo_calls(tiny_qwen_dir, tmp_path) -> None:
    """A soft-target session and a 1-D PPO session share passes (one decoder pass, each head
    with its own targets): loss, outputs, gradients and weights equal their solo calls'."""
    plans = [
        [_soft_call(10), _step, _soft_call(11, forward_only=True), _soft_call(12), _step],
        [_ppo_call(20), _step, _ppo_call(21), _ppo_call(22), _step],
    ]
    configs = [LoraConfig(rank=4, alpha=8, seed=31), LoraConfig(rank=8, alpha=16, seed=32)]
    want = _solo(make_resource(tiny_qwen_dir, tmp_path / "solo", options=SOLO), plans, configs)
    merged = make_resource(tiny_qwen_dir, tmp_path / "merged", options=MERGING)
    got = _concurrent(merged, plans, configs)
    for s, (records, refs) in enumerate(zip(got, want, strict=True)):
        for k, (record, ref) in enumerate(zip(records, refs, strict=True)):
            _compare(record, ref, f"session {s} op {k}")
    shared = [p for p in merged.scheduler.recent if {"s0", "s1"} <= set(p)]
    assert len(shared) >= 2, list(merged.scheduler.recent)


def _raw(tokens: list[int], inputs: dict[str, tuple[list[Any], str, list[int] | None]]) -> Sample:
    base = sample(tokens, [0] * len(tokens))
    base.loss_fn_inputs = {
        name: TensorData(data=data, dtype=dtype, shape=shape)  # type: ignore[arg-type]
        for name, (data, dtype, shape) in inputs.items()
    }
    return base


TOKENS = [3, 4, 5]
IDS, HALVES, ONES = [1, 2, 3, 4, 5, 6], [0.5] * 6, [1.0] * 6


def _ce(ids: list[int], ids_shape: Any, weights: list[float], weights_shape: Any) -> Sample:
    inputs = {
        "target_tokens": (ids, "int64", ids_shape),
        "weights": (weights, "float32", weights_shape),
    }
    return _raw(TOKENS, inputs)


def _ppo() -> Sample:
    floats = {"logprobs": ([-1.0] * 3, "float32", None), "advantages": ([1.0] * 3, "float32", None)}
    return _raw(TOKENS, {"target_tokens": (IDS, "int64", [3, 2]), **floats})


S0 = "samples[0].loss_fn_inputs"


@pytest.mark.parametrize(
    ("loss", "samples", "field"),
    [
        (CE, [_ce(IDS, [3, 2], [0.5] * 3, [3])], f"{S0}.weights.shape"),
        (CE, [_ce(IDS, [3, 2], HALVES, [2, 3])], f"{S0}.weights.shape"),
        (CE, [_ce([], [3, 0], [], [3, 0])], f"{S0}.target_tokens.shape"),
        (CE, [_ce(IDS[:4], [2, 2], ONES[:4], [2, 2])], f"{S0}.target_tokens.shape"),
        (CE, [_ce([1, 2, 3, 4, VOCAB, 6], [3, 2], HALVES, [3, 2])], f"{S0}.target_tokens[2][0]"),
        (CE, [_ce([1] * 387, [3, 129], [1.0] * 387, [3, 129])], f"{S0}.target_tokens.shape"),
        (CE, [_ce(IDS, [3, 2], HALVES, [3, 2]), _ce(IDS[:3], None, ONES[:3], None)],
         "samples[1].loss_fn_inputs.target_tokens.shape"),
        (PPO, [_ppo()], f"{S0}.target_tokens.shape"),
    ],
    ids=["weights-1d", "weights-transposed", "k0", "rows", "vocab", "k129", "mixed", "ppo"],
)  # fmt: skip
def test_bad_shapes_are_refused_naming_the_field(
    tiny_qwen_dir, tmp_path, loss: LossConfig, samples: list[Sample], field: str
) -> None:
    resource = make_resource(tiny_qwen_dir, tmp_path, generator=False)
    session = _session(resource, "s")
    with pytest.raises(OperationError) as caught:
        session.forward_backward(loss, samples)
    assert caught.value.code == "INVALID_INPUT", caught.value
    assert caught.value.message.startswith(f"{field}:"), caught.value.message


def test_custom_forward_backward_stays_1d(tiny_qwen_dir, tmp_path) -> None:
    from trainer.contract.specs import Gradient

    resource = make_resource(tiny_qwen_dir, tmp_path, generator=False)
    session = _session(resource, "s")
    soft = _ce(IDS, [3, 2], HALVES, [3, 2])
    with pytest.raises(OperationError, match=r"target_tokens\.shape"):
        session.custom_forward_backward([soft], [Gradient(data=[1.0, 1.0, 1.0])])


@pytest.mark.parametrize("forward_only", [False, True], ids=["forward-backward", "forward"])
def test_k_targets_cost_the_matmuls_of_one(tiny_qwen_dir, tmp_path, forward_only) -> None:
    """K targets per position are gathered from one log-softmax: a call with K = 8 runs
    exactly the matrix multiplications (FLOPs, counted by torch) of the same call with K = 1,
    head included, forward and backward."""
    from torch.utils.flop_counter import FlopCounterMode

    resource = make_resource(tiny_qwen_dir, tmp_path, generator=False)
    flops = {}
    for k in (1, 8):
        session = _session(resource, f"k{k}")
        samples = [soft_sample(*d) for d in tables(9, k=k)]
        counter = FlopCounterMode(display=False)
        with counter:
            session.forward_backward(CE, samples, forward_only=forward_only)
        flops[k] = counter.get_total_flops()
    assert flops[1] > 0 and flops[8] == flops[1], flops
