"""Many sessions in one pass, through the official SDK: four LoRA sessions of one resource,
with different ranks, alphas, `train_unembed` and losses (cross-entropy, PPO, GRPO token-mean,
and the SDK's custom forward-backward, whose per-token gradients the client computes from a
forward's logprobs), driven concurrently by four threads against a worker that merges their
calls. The reference is an independent solo run: a second worker with merging off
(`[engine] merge = false`) running the same operations on twin sessions (same seeds), one
session after the other.

Every number a client sees must agree within 1e-6 relative: losses, per-token outputs, loss
metrics, gradient norms (optim-step metrics), logprobs after each optim-step (the weights), and
every tensor of the training and inference checkpoints on disk (weights, AdamW state, RNG). The
merged worker's own counters (`GET /v1/rl/worker-metrics`) prove that passes held more than one
session.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from api_helpers import ce_sample, tensor
from conftest import TOKEN, LiveServer, serve_in_thread
from safetensors.torch import load_file
from together.post_training import ModelResourcesClient, SessionClient

REL = 5e-6  # fp32 summation order; kernels differ by CPU (AMD EPYC saw > 1e-6)
# Checkpoint tensors, by norm: AdamW divides by sqrt(v), so an element with a near-zero gradient
# turns the summation-order noise of a differently packed pass into a visible step (one element
# 7.6e-4 off of its tensor's largest on an AMD EPYC), while a session mixed up with another is
# off by O(1) of the whole tensor
NORM_REL = 1e-4
ABS = 1e-9  # for values that are exactly 0 in one run (masked positions)
CE = {"type": "LOSS_TYPE_CROSS_ENTROPY"}
PPO = {
    "type": "LOSS_TYPE_PPO",
    "ppo_params": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
}
GRPO = {
    "type": "LOSS_TYPE_GRPO",
    "grpo_params": {
        "clip_low_threshold": 0.9,
        "clip_high_threshold": 1.1,
        "beta": 0.05,
        "agg_type": "GRPO_LOSS_AGGREGATION_TYPE_TOKEN_MEAN",
        "ratio_type": "GRPO_LOSS_RATIO_TYPE_TOKEN",
    },
}
ADAM = {"learning_rate": 1e-2, "grad_clip_norm": 0.0}
STEPS = 2


@dataclass(frozen=True)
class Spec:
    name: str
    lora: dict[str, Any]
    loss: dict[str, Any] | None  # None: custom forward-backward
    sequences: list[list[int]]


SPECS = [
    Spec(
        "ce",
        {"rank": 4, "alpha": 8, "seed": 1, "train_unembed": True},
        CE,
        [[3, 17, 42, 9, 88, 5, 61, 20], [7, 7, 100, 2, 45, 12]],
    ),
    Spec(
        "ppo",
        {"rank": 8, "alpha": 32, "seed": 2, "train_unembed": False},
        PPO,
        [[11, 4, 90, 23, 8], [64, 3, 3, 51, 19, 77, 6, 30, 2]],
    ),
    Spec(
        "grpo",
        {"rank": 2, "alpha": 4, "seed": 3, "train_unembed": True},
        GRPO,
        [[5, 9, 17, 3, 44, 2, 8], [90, 4, 11, 60, 21, 33, 5, 1], [12, 13, 14]],
    ),
    Spec(
        "custom",
        {"rank": 16, "alpha": 16, "seed": 4, "train_unembed": False},
        None,
        [[40, 41, 2, 99, 13, 7], [8, 80, 18, 28, 38]],
    ),
]


def _advantages(n: int, row: int) -> list[float]:
    return [(-1.0) ** (t + row) * (0.5 + 0.25 * (t % 3)) for t in range(n)]


def _policy_samples(spec: Spec, logprobs: list[list[float]]) -> list[dict[str, Any]]:
    """Behaviour logprobs near the current ones (rounded, then shifted so that some ratios clip):
    the same inputs in both runs, whatever their last bits."""
    samples = []
    for row, (sequence, lps) in enumerate(zip(spec.sequences, logprobs, strict=True)):
        n = len(sequence) - 1
        behaviour = [round(lp, 2) + 0.15 * ((t % 3) - 1) for t, lp in enumerate(lps)]
        inputs = {
            "target_tokens": tensor(sequence[1:], "int64"),
            "logprobs": tensor(behaviour),
            "advantages": tensor(_advantages(n, row)),
            "mask": tensor([1.0] * n),
        }
        if spec.loss is GRPO:
            inputs["reference_logprobs"] = tensor([round(lp, 1) for lp in lps])
        samples.append(
            {"model_input": ce_sample(sequence)["model_input"], "loss_fn_inputs": inputs}
        )
    return samples


def _logprobs(result: Any) -> list[list[float]]:
    return [list(map(float, o.tensors["logprobs"].data)) for o in result.loss_fn_outputs]


def _metrics(result: Any) -> dict[str, float]:
    metrics = getattr(result, "metrics", None)
    if metrics is None and result.model_extra:
        metrics = result.model_extra.get("metrics")
    return {k: float(v) for k, v in dict(metrics or {}).items()}


def drive(session: SessionClient, spec: Spec, barrier: threading.Barrier | None) -> dict[str, Any]:
    """The session's operations, in order; with a barrier, each mergeable call is sent together
    with the other sessions' ones."""

    def sync() -> None:
        if barrier is not None:
            barrier.wait(timeout=120)

    trainer = session.trainer
    ce = [ce_sample(s) for s in spec.sequences]
    record: dict[str, Any] = {"steps": []}
    for _ in range(STEPS):
        step: dict[str, Any] = {}
        sync()
        forward = trainer.forward(samples=ce, loss=CE)
        step["forward_loss"], step["forward_logprobs"] = forward.loss, _logprobs(forward)
        sync()
        if spec.loss is None:  # custom loss: L = -sum adv * exp(logprob), dL/dlogprob below
            gradients = [
                {"data": [-a * math.exp(lp) for a, lp in zip(_advantages(len(lps), r), lps)]}
                for r, lps in enumerate(step["forward_logprobs"])
            ]
            trainer.custom_forward_backward(samples=ce, gradients=gradients)
        else:
            samples = ce if spec.loss is CE else _policy_samples(spec, step["forward_logprobs"])
            out = trainer.forward_backward(
                samples=samples, loss=spec.loss, return_loss_fn_outputs=True
            )
            step["loss"], step["outputs"] = out.loss, _logprobs(out)
            step["loss_metrics"] = _metrics(out)
        step["optim"] = _metrics(trainer.optim_step(adam_params=ADAM))
        record["steps"].append(step)
    sync()
    final = trainer.forward(samples=ce, loss=CE)
    record["final_logprobs"] = _logprobs(final)
    record["training_checkpoint"] = session.create_training_checkpoint().id
    record["inference_checkpoint"] = session.create_inference_checkpoint().id
    return record


def run_all(live: LiveServer, concurrent: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    with ModelResourcesClient.create(
        api_key=TOKEN,
        base_url=live.api,
        base_model="tiny-qwen",
        lora_enabled=True,
        inactive_timeout=600,
        interval=0.02,
    ) as resource:
        sessions = [resource.create_session(lora_config=s.lora, interval=0.02) for s in SPECS]
        records: list[dict[str, Any]] = [{} for _ in SPECS]
        if concurrent:
            barrier = threading.Barrier(len(SPECS))
            errors: list[BaseException] = []

            def work(i: int) -> None:
                try:
                    records[i] = drive(sessions[i], SPECS[i], barrier)
                except BaseException as exc:  # surfaced below
                    errors.append(exc)
                    barrier.abort()

            threads = [threading.Thread(target=work, args=(i,)) for i in range(len(SPECS))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(300)
            assert not errors, errors
        else:
            for i, (session, spec) in enumerate(zip(sessions, SPECS, strict=True)):
                records[i] = drive(session, spec, None)
        with live.client() as http:
            metrics = http.get("/rl/worker-metrics").json()
        for session in sessions:
            session.stop()
        return records, metrics


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=REL, abs_tol=ABS)


def assert_same(merged: Any, solo: Any, where: str) -> None:
    """Every number of `merged` equals `solo` within 1e-6 relative (same structure)."""
    if isinstance(solo, dict):
        assert merged.keys() == solo.keys(), where
        for key in solo:
            assert_same(merged[key], solo[key], f"{where}.{key}")
    elif isinstance(solo, list):
        assert len(merged) == len(solo), where
        for i, (m, s) in enumerate(zip(merged, solo, strict=True)):
            assert_same(m, s, f"{where}[{i}]")
    elif isinstance(solo, float):
        assert _close(merged, solo), f"{where}: merged {merged!r} vs solo {solo!r}"
    elif isinstance(solo, str) and where.endswith("checkpoint"):
        pass  # ids differ; the files are compared below
    else:
        assert merged == solo, where


def _tensors(storage: Path, checkpoint_id: str) -> dict[str, torch.Tensor]:
    root = storage / "checkpoints" / checkpoint_id
    out: dict[str, torch.Tensor] = {}
    for path in sorted(root.rglob("*.safetensors")):
        for key, value in load_file(str(path)).items():
            out[f"{path.relative_to(root).as_posix()}:{key}"] = value
    assert out, f"no tensors under {root}"
    return out


def assert_same_checkpoint(
    merged: dict[str, torch.Tensor], solo: dict[str, torch.Tensor], where: str
) -> None:
    assert merged.keys() == solo.keys(), where
    for name, expected in solo.items():
        got, key = merged[name], f"{where} {name}"
        assert got.dtype == expected.dtype and got.shape == expected.shape, key
        if not expected.is_floating_point():  # RNG states, step counters: bit-equal
            assert torch.equal(got, expected), key
            continue
        # the norm of the difference against the tensor's own norm (`NORM_REL`)
        diff = float((got.double() - expected.double()).norm())
        assert diff <= NORM_REL * float(expected.double().norm()) + ABS, (key, diff)


def test_four_sessions_merged_equal_each_alone(tiny_qwen_dir: Path, tmp_path: Path) -> None:
    models = {"tiny-qwen": tiny_qwen_dir}
    with serve_in_thread(tmp_path / "solo", models, engine={"merge": False}) as live:
        solo, solo_metrics = run_all(live, concurrent=False)
        solo_files = [
            (
                _tensors(live.storage, r["training_checkpoint"]),
                _tensors(live.storage, r["inference_checkpoint"]),
            )
            for r in solo
        ]
    engine = {"merge": True, "merge_window_ms": 200.0}
    with serve_in_thread(tmp_path / "merged", models, engine=engine) as live:
        merged, metrics = run_all(live, concurrent=True)
        merged_files = [
            (
                _tensors(live.storage, r["training_checkpoint"]),
                _tensors(live.storage, r["inference_checkpoint"]),
            )
            for r in merged
        ]

    assert solo_metrics["merged_passes"] == 0, solo_metrics  # the reference never merged
    # forwards and forward-backwards of the four sessions shared passes
    assert metrics["merged_passes"] >= 2 and metrics["max_sessions_per_pass"] >= 2, metrics
    assert metrics["merged_items"] >= 4, metrics
    for spec, m, s in zip(SPECS, merged, solo, strict=True):
        assert all(step["optim"]["grad_norm"] > 0 for step in s["steps"]), spec.name
        assert_same(m, s, spec.name)
    for spec, (m_train, m_inf), (s_train, s_inf) in zip(
        SPECS, merged_files, solo_files, strict=True
    ):
        assert any(k.startswith("optimizer.safetensors:") for k in s_train), s_train.keys()
        assert_same_checkpoint(m_train, s_train, f"{spec.name} training checkpoint")
        assert_same_checkpoint(m_inf, s_inf, f"{spec.name} inference checkpoint")
