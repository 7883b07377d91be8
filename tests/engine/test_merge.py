"""Merged passes across LoRA sessions (`trainer/engine/batching/pass_scheduler.py`,
`trainer/engine/batching/train_pass.py`) against a
solo run of the same operations.

Four sessions with different ranks, alphas, head LoRA (train_unembed) and losses (CE, PPO,
GRPO token-mean, custom forward-backward) send their calls from four threads at once, released
together by a barrier, on a resource that merges; the same operations run one at a time on a
resource with merging off are the reference. Loss, metrics, per-token outputs, gradients after
each forward-backward, optim-step metrics (gradient norm) and weights after each optim-step
agree within 1e-6 relative (fp32, CPU, dropout 0), and the scheduler's counters prove the calls
really shared passes.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

import torch

from tests.engine.helpers import grads_of, make_resource, random_batch, weights_of
from trainer.contract.errors import OperationError
from trainer.contract.options import EngineOptions
from trainer.contract.specs import AdamParams, Gradient, LoraConfig, LossConfig, SessionSpec

RTOL = 1e-6
MERGING = EngineOptions(merge_window_ms=200.0)  # generous: the barrier releases all at once
SOLO = EngineOptions(merge=False)

CE = LossConfig(type="cross_entropy")
PPO = LossConfig(type="ppo")
GRPO = LossConfig(
    type="grpo", grpo_params={"agg_type": "GRPO_LOSS_AGGREGATION_TYPE_TOKEN_MEAN", "beta": 0.0}
)
STEP = AdamParams(learning_rate=5e-2)

CONFIGS = [
    LoraConfig(rank=4, alpha=8, seed=11, train_unembed=True),
    LoraConfig(rank=8, alpha=32, seed=12, train_unembed=False),
    LoraConfig(rank=2, alpha=4, seed=13, train_unembed=True),
    LoraConfig(rank=16, alpha=16, seed=14, train_unembed=False),
]

Op = Callable[[Any], dict[str, Any]]


def _fb(kind: int, seed: int, forward_only: bool = False) -> Op:
    """Session `kind`'s call: 0 CE, 1 PPO, 2 GRPO token-mean, 3 custom forward-backward."""

    def op(session: Any) -> dict[str, Any]:
        if kind == 3:
            samples = random_batch(seed, n=3)
            gen = torch.Generator().manual_seed(seed)
            grads = [
                Gradient(data=torch.randn(len(s.model_input.tokens), generator=gen).tolist())
                for s in samples
            ]
            out = session.custom_forward_backward(samples, grads)
        else:
            loss, extra = [
                (CE, {"weights": "mask"}),
                (PPO, {"logprobs": "logprobs", "advantages": "x"}),
                (GRPO, {"logprobs": "logprobs", "advantages": "x"}),
            ][kind]
            samples = random_batch(seed, n=4, **extra)
            out = session.forward_backward(
                loss, samples, forward_only=forward_only, return_loss_fn_outputs=True
            )
        return {"result": out, "grads": grads_of(session)}

    return op


def _step(session: Any) -> dict[str, Any]:
    return {"result": session.optim_step(STEP), "weights": weights_of(session)}


def _plan(kind: int) -> list[Op]:
    """forward-backward, optim-step, forward only (sees the new weights: FIFO), two
    forward-backwards (accumulated), optim-step."""
    return [
        _fb(kind, 100 + kind),
        _step,
        _fb(kind, 200 + kind, forward_only=kind != 3),
        _fb(kind, 300 + kind),
        _fb(kind, 400 + kind),
        _step,
    ]


def _sessions(resource: Any, configs: list[LoraConfig]) -> list[Any]:
    return [
        resource.create_session(f"s{i}", SessionSpec(lora_config=c)) for i, c in enumerate(configs)
    ]


def _solo(resource: Any, plans: list[list[Op]], configs: list[LoraConfig]) -> list[list[Any]]:
    sessions = _sessions(resource, configs)
    records: list[list[Any]] = []
    for session, plan in zip(sessions, plans, strict=True):
        records.append([_call(op, session) for op in plan])
    return records


def _concurrent(resource: Any, plans: list[list[Op]], configs: list[LoraConfig]) -> list[list]:
    """Each session's plan on its own thread; every step starts on all threads at once."""
    sessions = _sessions(resource, configs)
    records: list[list[Any]] = [[] for _ in plans]
    barrier = threading.Barrier(len(plans))

    def drive(i: int) -> None:
        for op in plans[i]:
            barrier.wait(timeout=600)
            records[i].append(_call(op, sessions[i]))

    threads = [threading.Thread(target=drive, args=(i,)) for i in range(len(plans))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=900)
    assert not any(t.is_alive() for t in threads)
    return records


def _call(op: Op, session: Any) -> Any:
    try:
        return op(session)
    except OperationError as exc:
        return exc


def _close_tensor(got: torch.Tensor | None, want: torch.Tensor | None, where: str) -> None:
    """`‖got − want‖ ≤ 1e-6 ‖want‖` (Frobenius): relative to the tensor, not per element, since
    AdamW turns a last-bit difference of a near-zero gradient entry into a visible step."""
    if got is None or want is None:
        assert got is None and want is None, where
        return
    err, scale = float((got - want).double().norm()), float(want.double().norm())
    assert err <= RTOL * max(scale, 1e-30), f"{where}: ‖diff‖ {err:.3g} vs ‖want‖ {scale:.3g}"


def _close_number(got: float, want: float, where: str) -> None:
    assert math.isclose(got, want, rel_tol=RTOL, abs_tol=1e-12), f"{where}: {got} vs {want}"


def _compare(got: Any, want: Any, where: str) -> None:
    assert not isinstance(want, OperationError), f"{where}: the reference failed: {want!r}"
    assert not isinstance(got, OperationError), f"{where}: {got!r}"
    result, ref = got["result"], want["result"]
    assert result.keys() == ref.keys(), where
    if "loss" in ref:
        _close_number(result["loss"], ref["loss"], f"{where} loss")
    for name, value in ref.get("metrics", {}).items():
        _close_number(result["metrics"][name], value, f"{where} metrics[{name}]")
    assert result.get("metrics", {}).keys() == ref.get("metrics", {}).keys(), where
    if "step" in ref:
        assert result["step"] == ref["step"], where
    for i, (a, b) in enumerate(
        zip(result.get("loss_fn_outputs", []), ref.get("loss_fn_outputs", []), strict=True)
    ):
        _close_tensor(
            torch.tensor(a["tensors"]["logprobs"]["data"]),
            torch.tensor(b["tensors"]["logprobs"]["data"]),
            f"{where} outputs[{i}]",
        )
    for key in ("grads", "weights"):
        if key in want:
            assert got[key].keys() == want[key].keys(), where
            for name in want[key]:
                _close_tensor(got[key][name], want[key][name], f"{where} {key}[{name}]")


def test_four_sessions_merged_equal_solo(tiny_qwen_dir, tmp_path) -> None:
    plans = [_plan(kind) for kind in range(4)]
    reference = make_resource(tiny_qwen_dir, tmp_path / "solo", options=SOLO)
    want = _solo(reference, plans, CONFIGS)
    assert reference.scheduler.counters()["passes"] == 0  # merging off: one call per pass

    merged = make_resource(tiny_qwen_dir, tmp_path / "merged", options=MERGING)
    got = _concurrent(merged, plans, CONFIGS)
    for s, (records, refs) in enumerate(zip(got, want, strict=True)):
        for k, (record, ref) in enumerate(zip(records, refs, strict=True)):
            _compare(record, ref, f"session {s} op {k}")
    counters = merged.scheduler.counters()
    assert counters["merged_passes"] >= 1, counters
    assert counters["max_sessions_per_pass"] >= 2, counters
    assert counters["merged_items"] >= 2 * counters["merged_passes"], counters


def _failing_custom(value: float, why: str) -> Op:
    """A custom forward-backward that fails with NON_FINITE_LOSS: 3e38 per token overflows the
    loss (caught before the backward); 1e33 on one token per sample keeps the loss finite and
    overflows the gradients (caught after it)."""

    def op(session: Any) -> dict[str, Any]:
        samples = random_batch(41, n=3)
        fill = value if why == "loss" else 0.0
        grads = [Gradient(data=[value] + [fill] * (len(s.model_input.tokens) - 1)) for s in samples]
        try:
            session.custom_forward_backward(samples, grads)
        except OperationError as exc:
            assert why in exc.message, exc.message
            return {"result": {"error": exc.code}, "grads": grads_of(session)}
        raise AssertionError("the overflowing call completed")

    return op


def test_non_finite_loss_fails_only_its_session(tiny_qwen_dir, tmp_path) -> None:
    """In shared passes: session 1's calls overflow (the loss, then only the gradients) and fail
    with NON_FINITE_LOSS, leaving its accumulated gradients as they were; sessions 0 and 2
    complete with solo-equal numbers, and every session's optim-step after it equals the solo
    run's."""
    plans = [
        [_fb(0, 500), _fb(0, 510), _fb(0, 520), _step],
        [_fb(3, 501), _failing_custom(3e38, "loss"), _failing_custom(1e33, "gradient"), _step],
        [_fb(1, 502), _fb(1, 512), _fb(1, 522), _step],
    ]
    configs = CONFIGS[:3]
    want = _solo(make_resource(tiny_qwen_dir, tmp_path / "solo", options=SOLO), plans, configs)
    merged = make_resource(tiny_qwen_dir, tmp_path / "merged", options=MERGING)
    got = _concurrent(merged, plans, configs)
    for s, (records, refs) in enumerate(zip(got, want, strict=True)):
        for k, (record, ref) in enumerate(zip(records, refs, strict=True)):
            _compare(record, ref, f"session {s} op {k}")
    for failed in got[1][1:3]:
        assert failed["result"] == {"error": "NON_FINITE_LOSS"}
        for name, grad in got[1][0]["grads"].items():  # unchanged by the failure, bit for bit
            assert torch.equal(failed["grads"][name], grad), name
    shared = [p for p in merged.scheduler.recent if "s1" in p and len(p) > 1]
    assert len(shared) >= 3, list(merged.scheduler.recent)  # all of s1's calls were merged


def test_dropout_sessions_keep_their_own_streams(tiny_qwen_dir, tmp_path) -> None:
    """Sessions with LoRA dropout (one with a LoRA head, one without) share passes with a
    session without: each draws its masks from its own RNG stream, in solo order, so its loss,
    gradients, weights and the stream it continues with (a second forward-backward after the
    step) equal the solo run's, where other masks would be far off."""
    plans = [[_fb(0, 600), _step, _fb(0, 610)], [_fb(1, 601), _step, _fb(1, 611)]]
    plans.append([_fb(2, 602), _step, _fb(2, 612)])
    configs = [
        LoraConfig(rank=4, alpha=8, seed=21, dropout=0.3, train_unembed=True),
        LoraConfig(rank=8, alpha=32, seed=22, dropout=0.1, train_unembed=False),
        CONFIGS[2],
    ]
    want = _solo(make_resource(tiny_qwen_dir, tmp_path / "solo", options=SOLO), plans, configs)
    merged = make_resource(tiny_qwen_dir, tmp_path / "merged", options=MERGING)
    got = _concurrent(merged, plans, configs)
    for s, (records, refs) in enumerate(zip(got, want, strict=True)):
        for k, (record, ref) in enumerate(zip(records, refs, strict=True)):
            _compare(record, ref, f"session {s} op {k}")
    shared = [p for p in merged.scheduler.recent if {"s0", "s1"} <= set(p)]
    assert len(shared) >= 2, list(merged.scheduler.recent)
    # the masks matter: the same session without its stream (another seed) is far off
    other = make_resource(tiny_qwen_dir, tmp_path / "other", options=SOLO)
    moved = other.create_session("x", SessionSpec(lora_config=configs[0]))
    moved.cpu_rng = torch.Generator().manual_seed(999).get_state()
    grads = _fb(0, 600)(moved)["grads"]  # lora_B starts at 0: the masks show in the gradients
    name = next(n for n in grads if "lora_B" in n)
    assert not torch.allclose(grads[name], want[0][0]["grads"][name], rtol=1e-2)


def test_merging_off_runs_alone(tiny_qwen_dir, tmp_path) -> None:
    """With `[engine] merge = false` nothing goes through the combiner, concurrent or not."""
    plans = [[_fb(0, 700), _step], [_fb(1, 701), _step]]
    resource = make_resource(tiny_qwen_dir, tmp_path / "off", options=SOLO)
    got = _concurrent(resource, plans, CONFIGS[:2])
    want = _solo(make_resource(tiny_qwen_dir, tmp_path / "solo", options=SOLO), plans, CONFIGS[:2])
    for s, (records, refs) in enumerate(zip(got, want, strict=True)):
        for k, (record, ref) in enumerate(zip(records, refs, strict=True)):
            _compare(record, ref, f"session {s} op {k}")
    assert resource.scheduler.counters() == {
        "passes": 0,
        "merged_passes": 0,
        "merged_items": 0,
        "max_sessions_per_pass": 0,
    }


def test_padded_attention_dropout_runs_alone(tiny_qwen_dir, tmp_path) -> None:
    """With a padded attention (eager) a dropout session's solo masks cover the padding too, so
    it never shares a pass; a session without dropout still does not wait for it."""
    plans = [[_fb(0, 800)], [_fb(1, 801)]]
    configs = [LoraConfig(rank=4, alpha=8, seed=31, dropout=0.2), CONFIGS[1]]
    resources = []
    for name, options in (("solo", SOLO), ("merged", MERGING)):
        resource = make_resource(tiny_qwen_dir, tmp_path / name, options=options)
        resource.model.set_attn_implementation("eager")
        resources.append(resource)
    want = _solo(resources[0], plans, configs)
    got = _concurrent(resources[1], plans, configs)
    for s, (records, refs) in enumerate(zip(got, want, strict=True)):
        _compare(records[0], refs[0], f"session {s}")
    assert resources[1].scheduler.counters()["merged_passes"] == 0


def test_activation_checkpointing_merged_equal_solo(tiny_qwen_dir, tmp_path) -> None:
    """Recomputed decoder layers (activation checkpointing) in a merged backward still apply
    each session's adapter and replay its dropout masks: solo numbers."""
    plans = [[_fb(0, 900), _step, _fb(0, 910)], [_fb(1, 901), _step, _fb(1, 911)]]
    configs = [LoraConfig(rank=4, alpha=8, seed=41, dropout=0.25), CONFIGS[1]]
    recompute = {"activation_checkpointing": True}
    solo = make_resource(
        tiny_qwen_dir, tmp_path / "solo", options=SOLO.model_copy(update=recompute)
    )
    want = _solo(solo, plans, configs)
    options = MERGING.model_copy(update=recompute)
    merged = make_resource(tiny_qwen_dir, tmp_path / "merged", options=options)
    got = _concurrent(merged, plans, configs)
    for s, (records, refs) in enumerate(zip(got, want, strict=True)):
        for k, (record, ref) in enumerate(zip(records, refs, strict=True)):
            _compare(record, ref, f"session {s} op {k}")
    assert merged.scheduler.counters()["merged_passes"] >= 2, merged.scheduler.counters()


def test_a_failed_pass_fails_every_call_and_leaves_no_trace(tiny_qwen_dir, tmp_path) -> None:
    """The model itself fails inside a merged pass (a device OOM in the decoder): every call in
    it fails with that error, and each session keeps the gradients and RNG state it had."""
    resource = make_resource(tiny_qwen_dir, tmp_path, options=MERGING)
    configs = [LoraConfig(rank=4, alpha=8, seed=51, dropout=0.2), CONFIGS[1]]
    sessions = _sessions(resource, configs)
    for kind, session in enumerate(sessions):
        _fb(kind, 950 + kind)(session)
    held = [(grads_of(s), s.cpu_rng.clone()) for s in sessions]
    decoder = resource.model.get_decoder()

    def oom(*_: Any) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    handle = decoder.register_forward_pre_hook(oom)
    errors: list[BaseException | None] = [None, None]
    barrier = threading.Barrier(2)

    def drive(i: int) -> None:
        barrier.wait(timeout=600)
        try:
            _fb(i, 960 + i)(sessions[i])
        except BaseException as exc:
            errors[i] = exc

    try:
        threads = [threading.Thread(target=drive, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(600)
    finally:
        handle.remove()
    assert all(isinstance(e, torch.OutOfMemoryError) for e in errors), errors
    assert (("s0", "s1") in resource.scheduler.recent) or (
        ("s1", "s0") in resource.scheduler.recent
    )
    for session, (grads, rng) in zip(sessions, held, strict=True):
        for name, grad in grads.items():
            assert torch.equal(session.policy.trainable[name].grad, grad), name
        assert torch.equal(session.cpu_rng, rng)
