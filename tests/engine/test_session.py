"""Session operations against independent references: plain transformers, explicit AdamW."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from tests.engine.helpers import (
    assert_same,
    grads_of,
    make_resource,
    model_input,
    random_batch,
    sample,
    weights_of,
)
from trainer.compute import optim
from trainer.contract.errors import OperationError
from trainer.contract.specs import (
    AdamParams,
    Gradient,
    LoraConfig,
    LossConfig,
    SamplingParams,
    SessionSpec,
)

CE = LossConfig(type="cross_entropy")


def _plain_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _naive_logprobs(model, s) -> torch.Tensor:
    """Reference: one unpadded sequence, full logits, log_softmax, gather."""
    logits = model(input_ids=torch.tensor([s.model_input.tokens])).logits[0].float()
    targets = torch.tensor([int(t) for t in s.loss_fn_inputs["target_tokens"].data])
    return torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)


def _floats(s, name) -> torch.Tensor:
    return torch.tensor(s.loss_fn_inputs[name].data, dtype=torch.float32)


def _outputs(result) -> list[torch.Tensor]:
    return [torch.tensor(o["tensors"]["logprobs"]["data"]) for o in result["loss_fn_outputs"]]


# -- forward, step 0 -------------------------------------------------------------------------


def test_lora_step0_logprobs_equal_base_model(tiny_model_dir, tmp_path) -> None:
    resource = make_resource(tiny_model_dir, tmp_path)
    session = resource.create_session("a", SessionSpec(lora_config=LoraConfig(rank=8, seed=3)))
    samples = random_batch(0, n=5, weights="ones")
    out = session.forward_backward(CE, samples, forward_only=True, return_loss_fn_outputs=True)
    plain = _plain_model(tiny_model_dir)
    with torch.no_grad():
        for got, s in zip(_outputs(out), samples, strict=True):
            torch.testing.assert_close(got, _naive_logprobs(plain, s), atol=1e-5, rtol=0)
    assert all(p.grad is None for p in session.policy.trainable.values())  # forward only


def test_lora_step0_grpo_ratio_one_kl_zero(tiny_qwen_dir, tmp_path) -> None:
    resource = make_resource(tiny_qwen_dir, tmp_path)
    session = resource.create_session("a", SessionSpec())
    base = random_batch(1, n=4, weights="ones")
    lps = _outputs(
        session.forward_backward(CE, base, forward_only=True, return_loss_fn_outputs=True)
    )
    samples = [
        sample(
            s.model_input.tokens,
            [int(t) for t in s.loss_fn_inputs["target_tokens"].data],
            logprobs=lp.tolist(),
            reference_logprobs=lp.tolist(),
            advantages=[1.0] * len(lp),
        )
        for s, lp in zip(base, lps, strict=True)
    ]
    grpo = LossConfig(type="grpo", grpo_params={"beta": 0.1})
    out = session.forward_backward(grpo, samples, forward_only=True)
    assert out["metrics"]["loss/ratio/mean"] == pytest.approx(1.0, abs=1e-6)
    assert out["metrics"]["loss/kl_ref/mean"] == pytest.approx(0.0, abs=1e-6)
    assert out["metrics"]["loss/clip/high_fraction"] == 0.0
    assert out["metrics"]["loss/clip/low_fraction"] == 0.0


# -- forward-backward against a plain transformers model ------------------------------------


def _reference_grads(model_dir, samples, loss_fn) -> tuple[float, dict[str, torch.Tensor]]:
    model = _plain_model(model_dir)
    model.requires_grad_(True)
    total = loss_fn([_naive_logprobs(model, s) for s in samples])
    total.backward()
    return float(total.detach()), {n: p.grad for n, p in model.named_parameters()}


def _ce_reference(samples):
    def fn(lps):
        return sum(-(_floats(s, "weights") * lp).sum() for s, lp in zip(samples, lps, strict=True))

    return fn


def _grpo_seq_mean_reference(samples, lo=0.8, hi=1.28):
    def fn(lps):
        per_sample = []
        for s, lp in zip(samples, lps, strict=True):
            m = _floats(s, "mask")
            ratio = torch.exp(torch.where(m != 0, lp - _floats(s, "logprobs"), 0.0))
            adv = _floats(s, "advantages")
            ell = -torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv)
            per_sample.append((m * ell).sum() / max(1.0, float(m.sum())))
        return sum(per_sample) / len(samples)

    return fn


@pytest.mark.parametrize("case", ["ce", "grpo_sequence_mean"])
def test_full_weight_gradients_match_plain_transformers(tiny_model_dir, tmp_path, case) -> None:
    if case == "ce":
        samples = random_batch(3, n=5, weights="randn")
        loss, reference = CE, _ce_reference(samples)
    else:
        samples = random_batch(4, n=5, logprobs="logprobs", advantages="randn", mask="mask")
        loss = LossConfig(
            type="grpo", grpo_params={"agg_type": "GRPO_LOSS_AGGREGATION_TYPE_SEQUENCE_MEAN"}
        )
        reference = _grpo_seq_mean_reference(samples)
    resource = make_resource(tiny_model_dir, tmp_path, lora=False)
    session = resource.create_session("a", SessionSpec())
    out = session.forward_backward(loss, samples)
    ref_loss, ref_grads = _reference_grads(tiny_model_dir, samples, reference)
    assert out["loss"] == pytest.approx(ref_loss, rel=1e-5, abs=1e-5)
    ours = grads_of(session)
    for name, grad in ours.items():
        torch.testing.assert_close(grad, ref_grads[name], atol=2e-5, rtol=1e-4)


def test_gradients_accumulate_across_calls(tiny_qwen_dir, tmp_path) -> None:
    resource = make_resource(tiny_qwen_dir, tmp_path)
    session = resource.create_session("a", SessionSpec(lora_config=LoraConfig(seed=1)))
    first, second = random_batch(5, n=2, weights="ones"), random_batch(6, n=3, weights="ones")
    session.forward_backward(CE, first)
    session.forward_backward(CE, second)
    accumulated = grads_of(session)
    session.optimizer.zero_grad(set_to_none=True)
    session.forward_backward(CE, first + second)
    together = grads_of(session)
    for name in together:
        if together[name] is not None:
            torch.testing.assert_close(accumulated[name], together[name], atol=1e-5, rtol=1e-4)


def test_custom_gradients_equal_cross_entropy_with_negated_weights(tiny_qwen_dir, tmp_path) -> None:
    samples = random_batch(7, n=4, weights="randn")
    resource = make_resource(tiny_qwen_dir, tmp_path, lora=False)
    session = resource.create_session("a", SessionSpec())
    gradients = [Gradient(data=[-w for w in s.loss_fn_inputs["weights"].data]) for s in samples]
    bare = [
        sample(s.model_input.tokens, [int(t) for t in s.loss_fn_inputs["target_tokens"].data])
        for s in samples
    ]
    assert session.custom_forward_backward(bare, gradients) == {}
    custom = grads_of(session)
    session.optimizer.zero_grad(set_to_none=True)
    session.forward_backward(CE, samples)
    for name, grad in grads_of(session).items():
        torch.testing.assert_close(custom[name], grad, atol=1e-6, rtol=1e-5)


# -- optimizer ------------------------------------------------------------------------------


def test_optim_step_matches_explicit_adamw(tiny_qwen_dir, tmp_path) -> None:
    """Two steps against a hand-written AdamW (decoupled decay, bias correction, clipping)."""
    resource = make_resource(tiny_qwen_dir, tmp_path)
    session = resource.create_session("a", SessionSpec(lora_config=LoraConfig(seed=2)))
    params = AdamParams(
        learning_rate=1e-2, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.1, grad_clip_norm=0.5
    )
    ref = {n: p.detach().clone().double() for n, p in session.policy.trainable.items()}
    m = {n: torch.zeros_like(p) for n, p in ref.items()}
    v = {n: torch.zeros_like(p) for n, p in ref.items()}
    for t in (1, 2):
        session.forward_backward(CE, random_batch(10 + t, n=3, weights="ones"))
        grads = {n: g.double() for n, g in grads_of(session).items()}
        norm = math.sqrt(sum(float((g**2).sum()) for g in grads.values()))
        out = session.optim_step(params)
        assert out["step"] == t
        assert out["metrics"]["grad_norm"] == pytest.approx(norm, rel=1e-5)
        scale = min(1.0, params.grad_clip_norm / (norm + 1e-6))
        for n in ref:
            g = grads[n] * scale
            ref[n] *= 1 - params.learning_rate * params.weight_decay
            m[n] = params.beta1 * m[n] + (1 - params.beta1) * g
            v[n] = params.beta2 * v[n] + (1 - params.beta2) * g * g
            m_hat = m[n] / (1 - params.beta1**t)
            v_hat = v[n] / (1 - params.beta2**t)
            ref[n] -= params.learning_rate * m_hat / (v_hat.sqrt() + params.eps)
        for n, p in session.policy.trainable.items():
            torch.testing.assert_close(p.detach().double(), ref[n], atol=1e-6, rtol=1e-5)
        assert all(p.grad is None for p in session.policy.trainable.values())
    assert session.policy_state()["trainer_step"] == 2


def test_optim_step_defaults_and_no_clip(tiny_qwen_dir, tmp_path) -> None:
    resource = make_resource(tiny_qwen_dir, tmp_path)
    session = resource.create_session("a", SessionSpec())
    session.forward_backward(CE, random_batch(3, weights="ones"))
    out = session.optim_step(AdamParams(grad_clip_norm=0))
    assert out["metrics"]["grad_norm_clipped"] == out["metrics"]["grad_norm"]
    group = session.optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (
        1e-4,
        (0.9, 0.95),
        1e-8,
        0.0,
    )


# -- atomicity --------------------------------------------------------------------------------


def test_failed_forward_backward_leaves_no_trace(tiny_qwen_dir, tmp_path) -> None:
    resource = make_resource(tiny_qwen_dir, tmp_path)
    session = resource.create_session("a", SessionSpec())
    session.forward_backward(CE, random_batch(1, weights="ones"))
    before_grads, before_weights = grads_of(session), weights_of(session)
    bad = [*random_batch(2, n=3, weights="ones"), sample([1, 2], [2, 999], weights=[1, 1])]
    with pytest.raises(OperationError) as info:
        session.forward_backward(CE, bad)
    assert info.value.code == "INVALID_INPUT"
    assert "samples[3].loss_fn_inputs.target_tokens[1]" in info.value.message
    # a non-finite loss: sampler logprobs so low that the importance ratio overflows
    overflow = [
        sample([3, 4, 5], [4, 5, 6], logprobs=[-1e4] * 3, advantages=[1.0] * 3),
    ]
    with pytest.raises(OperationError) as info:
        session.forward_backward(LossConfig(type="importance_sampling"), overflow)
    assert info.value.code == "NON_FINITE_LOSS"
    assert_same(grads_of(session), before_grads)
    assert_same(weights_of(session), before_weights)


def test_failed_optim_step_leaves_no_trace(tiny_qwen_dir, tmp_path) -> None:
    resource = make_resource(tiny_qwen_dir, tmp_path)
    session = resource.create_session("a", SessionSpec())
    session.forward_backward(CE, random_batch(1, weights="ones"))
    session.optim_step(AdamParams(learning_rate=1e-2))
    session.forward_backward(CE, random_batch(2, weights="ones"))
    next(iter(session.policy.trainable.values())).grad[0, 0] = float("nan")  # type: ignore[index]
    weights = weights_of(session)
    state = {k: v.clone() for k, v in optim_state(session).items()}
    with pytest.raises(OperationError) as info:
        session.optim_step(AdamParams(learning_rate=1e-2))
    assert info.value.code == "NON_FINITE_LOSS"
    assert_same(weights_of(session), weights)
    assert_same(optim_state(session), state)
    assert session.step == 1 and session.policy_state()["trainer_step"] == 1


# -- LoRA isolation -----------------------------------------------------------------------------


def test_two_lora_sessions_are_isolated(tiny_qwen_dir, tmp_path) -> None:
    resource = make_resource(tiny_qwen_dir, tmp_path)
    a = resource.create_session("a", SessionSpec(lora_config=LoraConfig(seed=1)))
    b = resource.create_session("b", SessionSpec(lora_config=LoraConfig(rank=4, seed=2)))
    probe = random_batch(9, n=3, weights="ones")

    def logprobs(session):
        out = session.forward_backward(CE, probe, forward_only=True, return_loss_fn_outputs=True)
        return _outputs(out)

    b_before, b_weights = logprobs(b), weights_of(b)
    for step in range(3):
        a.forward_backward(CE, random_batch(20 + step, weights="ones"))
        a.optim_step(AdamParams(learning_rate=5e-2))
    a_grads_none = grads_of(a)
    b.forward_backward(CE, random_batch(30, weights="ones"))
    assert_same(grads_of(a), a_grads_none)  # b's backward put nothing into a's tensors
    assert_same(weights_of(b), b_weights)
    for x, y in zip(logprobs(b), b_before, strict=True):
        assert torch.equal(x, y)
    assert any(not torch.allclose(x, y) for x, y in zip(logprobs(a), b_before, strict=True))
    assert not set(map(id, a.policy.trainable.values())) & set(map(id, b.policy.trainable.values()))


def test_lora_seed_makes_init_reproducible(tiny_qwen_dir, tmp_path) -> None:
    resource = make_resource(tiny_qwen_dir, tmp_path)
    a = resource.create_session("a", SessionSpec(lora_config=LoraConfig(seed=7)))
    b = resource.create_session("b", SessionSpec(lora_config=LoraConfig(seed=7)))
    c = resource.create_session("c", SessionSpec(lora_config=LoraConfig(seed=8)))
    assert_same(weights_of(a), weights_of(b))
    lora_a = next(n for n in weights_of(a) if "lora_A" in n)
    assert not torch.equal(weights_of(a)[lora_a], weights_of(c)[lora_a])
    assert all(float(p.abs().max()) == 0 for n, p in weights_of(a).items() if "lora_B" in n)
    head = [n for n in weights_of(a) if "lm_head" in n]
    assert head, "train_unembed puts a LoRA on lm_head"


def test_seeded_dropout_is_reproducible_on_its_device(tiny_qwen_dir, tmp_path) -> None:
    """A seeded session's dropout masks come from its seed on the device that computes (CUDA
    too), not from whatever the process's global streams hold when it is created: two
    sessions of one seed, with the global streams moved between them, get the same gradients,
    while the same session on another seed's streams gets other masks."""
    from tests.engine.helpers import DEVICE
    from trainer.compute.policy import cuda_devices

    resource = make_resource(tiny_qwen_dir, tmp_path)
    batch = random_batch(41, n=3, weights="ones")
    config = LoraConfig(rank=4, alpha=8, seed=7, dropout=0.5)

    def grads(session) -> dict:
        session.forward_backward(CE, batch)
        return grads_of(session)

    first = grads(resource.create_session("a", SessionSpec(lora_config=config)))
    torch.rand(1000, device=DEVICE)  # the global streams move on
    torch.manual_seed(12345)
    again = grads(resource.create_session("b", SessionSpec(lora_config=config)))
    assert_same(first, again)
    moved = resource.create_session("c", SessionSpec(lora_config=config))
    with torch.random.fork_rng(devices=cuda_devices()):
        torch.manual_seed(999)
        moved.cpu_rng = torch.get_rng_state()
        moved.cuda_rng = [torch.cuda.get_rng_state(i) for i in cuda_devices()]
    other = grads(moved)  # lora_B starts at 0: the masks show in its gradients
    name = next(n for n in first if "lora_B" in n)
    assert not torch.allclose(first[name], other[name])


def test_full_weight_resource_hosts_one_session(tiny_qwen_dir, tmp_path) -> None:
    resource = make_resource(tiny_qwen_dir, tmp_path, lora=False)
    first = resource.create_session("a", SessionSpec())
    with pytest.raises(OperationError):
        resource.create_session("b", SessionSpec())
    first.forward_backward(CE, random_batch(1, weights="ones"))
    first.optim_step(AdamParams(learning_rate=1e-2))
    resource.close_session("a")
    second = resource.create_session("b", SessionSpec())
    plain = _plain_model(tiny_qwen_dir)
    for name, param in plain.named_parameters():  # the next session starts from the base weights
        assert torch.equal(second.policy.trainable[name].detach(), param.detach()), name


# -- generator and versions -----------------------------------------------------------------------


def test_sampled_logprobs_match_forward_and_versions_move(tiny_qwen_dir, tmp_path) -> None:
    resource = make_resource(tiny_qwen_dir, tmp_path)
    session = resource.create_session("a", SessionSpec(lora_config=LoraConfig(seed=4)))
    prompts = [model_input([5, 6, 7]), model_input([9, 10, 11, 12, 13])]
    params = SamplingParams(max_tokens=6, seed=1, temperature=1.0)
    first = session.sample(prompts, num_samples=3, sampling_params=params)
    again = session.sample(prompts, num_samples=3, sampling_params=params)
    assert first == again  # seeded sampling is reproducible
    for prompt, result in zip(prompts, first["results"], strict=True):
        assert result["policy_segments"] == [{"start_token": 0, "version": 0}]
        assert len(result["sequences"]) == 3
        for seq in result["sequences"]:
            tokens = prompt.tokens + seq["tokens"]
            n_prompt = len(prompt.tokens)
            weights = [0.0] * (n_prompt - 1) + [1.0] * len(seq["tokens"])
            probe = sample(tokens[:-1], tokens[1:], weights=weights)
            out = session.forward_backward(
                CE, [probe], forward_only=True, return_loss_fn_outputs=True
            )
            forward = _outputs(out)[0][n_prompt - 1 :]
            torch.testing.assert_close(forward, torch.tensor(seq["logprobs"]), atol=1e-4, rtol=0)

    session.forward_backward(CE, random_batch(1, weights="ones"))
    session.optim_step(AdamParams(learning_rate=0.1))
    stale = session.sample(prompts, num_samples=3, sampling_params=params)
    assert stale == first  # optim-step alone does not reach the generator
    assert session.policy_state() == {
        "trainer_step": 1,
        "target_weights_version": 0,
        "applied_weights_version": 0,
        "pending_publish": False,
    }
    assert session.weights_sync("WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH") == {"weights_version": 1}
    assert session.policy_state()["pending_publish"] is True
    assert session.policy_state()["applied_weights_version"] == 0
    fresh = session.sample(prompts, num_samples=3, sampling_params=params)
    assert fresh["results"][0]["policy_segments"][0]["version"] == 1
    assert fresh != first
    assert session.policy_state() == {
        "trainer_step": 1,
        "target_weights_version": 1,
        "applied_weights_version": 1,
        "pending_publish": False,
    }


def test_prompt_logprobs_and_topk(tiny_qwen_dir, tmp_path) -> None:
    resource = make_resource(tiny_qwen_dir, tmp_path)
    session = resource.create_session("a", SessionSpec())
    prompt = [5, 6, 7, 8]
    out = session.sample(
        [model_input(prompt)],
        num_samples=1,
        sampling_params=SamplingParams(max_tokens=1),
        prompt_logprobs=True,
        topk_prompt_logprobs=3,
    )["results"][0]
    plain = _plain_model(tiny_qwen_dir)
    with torch.no_grad():
        expected = _naive_logprobs(plain, sample(prompt[:-1], prompt[1:]))
    assert out["prompt_logprobs"][0] == 0.0
    torch.testing.assert_close(
        torch.tensor(out["prompt_logprobs"][1:]), expected, atol=1e-5, rtol=0
    )
    assert out["topk_prompt_logprobs"][0] == {"token_ids": [], "logprobs": []}
    assert all(len(t["token_ids"]) == 3 for t in out["topk_prompt_logprobs"][1:])


def test_sampling_input_errors(tiny_qwen_dir, tmp_path) -> None:
    resource = make_resource(tiny_qwen_dir, tmp_path)
    session = resource.create_session("a", SessionSpec())
    cases = [
        ({"model_inputs": []}, "model_inputs"),
        ({"sampling_params": SamplingParams(stop=["x"])}, "sampling_params.stop"),
        ({"sampling_params": SamplingParams(max_tokens=1000)}, "sampling_params.max_tokens"),
        ({"num_samples": 0}, "num_samples"),
        ({"topk_prompt_logprobs": 21}, "topk_prompt_logprobs"),
    ]
    for kwargs, field in cases:
        args = {"model_inputs": [model_input([3, 4])], **kwargs}
        with pytest.raises(OperationError) as info:
            session.sample(args.pop("model_inputs"), **args)
        assert info.value.message.startswith(field), info.value.message

    no_gen = make_resource(tiny_qwen_dir, tmp_path / "nogen", generator=False)
    trainer_only = no_gen.create_session("t", SessionSpec())
    with pytest.raises(OperationError, match="num_generator_replicas"):
        trainer_only.sample([model_input([3, 4])])


def optim_state(session: Any) -> dict[str, torch.Tensor]:
    return optim.state_tensors(session.optimizer, session.policy.trainable)
