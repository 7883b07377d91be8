"""The engine's comparisons: which arms each row runs, at what size, and what it concludes.

Every row runs its arms one after the other (each in a fresh process unless `inprocess`) and
turns their medians into one ratio; both sides of a ratio come from the same run.
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness import Measurement, run_child
from benchmarks.shapes import ModelShape, save_model


@dataclass
class RowResult:
    num: int
    comparison: str
    measured: str
    target: str
    met: bool | None  # None: not measured (skipped, or a dependency is missing)
    details: list[str] = field(default_factory=list)


@dataclass
class Context:
    quick: bool
    inprocess: bool
    workdir: Path
    log: Callable[[str], None] = print

    def run(self, arm: str, params: dict[str, Any]) -> Measurement:
        self.log(f"  {arm} {_brief(params)}")
        if self.inprocess:
            from benchmarks.arms import run_inprocess  # every arm's imports: only on demand

            return run_inprocess(arm, params)
        return run_child(arm, params)

    def model_dir(self, shape: ModelShape) -> str:
        key = "-".join(str(v) for v in shape.to_json().values())
        return str(save_model(shape, self.workdir / f"model-{key}"))

    def model(self, shape: ModelShape) -> dict[str, Any]:
        """An arm's `shape` and `model_dir` parameters (the model saved once per shape)."""
        return {"shape": shape.to_json(), "model_dir": self.model_dir(shape)}


def _brief(params: dict[str, Any]) -> str:
    keys = ("impl", "layout", "kind", "tokens", "reps")
    return " ".join(f"{k}={params[k]}" for k in keys if k in params)


def _ms(m: Measurement) -> str:
    return f"{m.median * 1e3:.1f} ms" if m.median < 1 else f"{m.median:.2f} s"


def _ok(value: float, bound: float, at_least: bool) -> bool:
    return value >= bound if at_least else value <= bound


# -- shapes -----------------------------------------------------------------------------------


def _shapes(quick: bool) -> dict[str, ModelShape]:
    if quick:
        tiny = ModelShape(vocab=2048, hidden=32, intermediate=64, layers=1, heads=2, head_dim=16)
        return dict.fromkeys(
            ("head", "grpo", "lm_head", "decoder", "packing", "sync", "ckpt", "http", "memory"),
            tiny,
        )
    return {
        "head": ModelShape(hidden=32, intermediate=96, heads=2),
        "grpo": ModelShape(hidden=32, intermediate=96, layers=2, heads=2),
        "lm_head": ModelShape(hidden=256, intermediate=768, layers=1, heads=4, head_dim=64),
        "decoder": ModelShape(
            vocab=8192, hidden=512, intermediate=1536, layers=4, heads=8, kv_heads=4, head_dim=64
        ),
        "packing": ModelShape(
            vocab=8192, hidden=256, intermediate=768, layers=4, heads=4, head_dim=64
        ),
        "sync": ModelShape(
            hidden=1024, intermediate=3072, layers=4, heads=16, kv_heads=8, head_dim=64
        ),
        "ckpt": ModelShape(hidden=192, intermediate=576, layers=2, heads=4, head_dim=48),
        "http": ModelShape(hidden=32, intermediate=96, layers=2, heads=2),
        "memory": ModelShape(
            hidden=512, intermediate=1536, layers=4, heads=8, kv_heads=4, head_dim=64
        ),
    }


# -- rows -------------------------------------------------------------------------------------


def row_head(ctx: Context) -> RowResult:
    from safetensors.torch import load_file

    shape = _shapes(ctx.quick)["head"]
    tokens = 256 if ctx.quick else 4096
    reps = 1 if ctx.quick else 3
    out: dict[str, Measurement] = {}
    for impl in ("ours", "naive"):
        params = {
            "shape": shape.to_json(),
            "tokens": tokens,
            "impl": impl,
            "reps": reps,
            "chunk": 1024,
            "dump": str(ctx.workdir / f"head-{impl}.safetensors"),
        }
        out[impl] = ctx.run("head", params)
    a = load_file(str(ctx.workdir / "head-ours.safetensors"))
    b = load_file(str(ctx.workdir / "head-naive.safetensors"))
    lp_diff = float((a["logprobs"] - b["logprobs"]).abs().max())
    gh = float((a["grad_hidden"] - b["grad_hidden"]).abs().max())
    gw = float((a["grad_weight"] - b["grad_weight"]).abs().max())
    mem = out["naive"].peak_extra_mb / max(out["ours"].peak_extra_mb, 1e-9)
    time_ratio = out["ours"].median / out["naive"].median
    met = _ok(mem, 4, True) and _ok(time_ratio, 1.3, False) and lp_diff <= 1e-5
    return RowResult(
        1,
        f"logprobs + backward, T={tokens}: ours vs naive fp32 logits ({shape.describe()})",
        f"{mem:.1f}x less peak memory; {time_ratio:.2f}x the time; max abs Δlp {lp_diff:.1e}",
        "≥ 4x less memory, ≤ 1.3x time, ≤ 1e-5",
        met,
        [
            f"ours {_ms(out['ours'])}, peak +{out['ours'].peak_extra_mb:.0f} MB; naive "
            f"{_ms(out['naive'])}, peak +{out['naive'].peak_extra_mb:.0f} MB",
            f"max abs Δ grad hidden {gh:.1e}, max abs Δ grad W {gw:.1e}",
        ],
    )


def _grpo_batch(quick: bool) -> dict[str, Any]:
    if quick:
        return {"seed": 0, "n": 4, "prompt": [4, 12], "completion": [8, 24]}
    return {"seed": 0, "n": 8, "prompt": [32, 192], "completion": [64, 320]}


def row_grpo(ctx: Context) -> RowResult:
    try:
        import trl  # noqa: F401
    except ImportError:
        return RowResult(2, "GRPO forward-backward: ours vs TRL", "trl not installed", "", None)
    shape = _shapes(ctx.quick)["grpo"]
    base = {
        **ctx.model(shape),
        "batch": _grpo_batch(ctx.quick),
        "reps": 1 if ctx.quick else 3,
    }
    ours = ctx.run("grpo_ours", base)
    theirs = ctx.run("grpo_trl", {**base, "reps": 1 if ctx.quick else 2})  # ~9x slower
    time_ratio = ours.median / theirs.median
    mem = ours.peak_extra_mb / max(theirs.peak_extra_mb, 1e-9)
    diff = abs(ours.extra["loss"] - theirs.extra["loss"])
    met = _ok(time_ratio, 0.8, False) and _ok(mem, 0.5, False) and diff <= 1e-5
    return RowResult(
        2,
        f"GRPO fwd-bwd, {ours.extra['tokens']} tokens in 8 mixed samples: ours vs TRL "
        f"{theirs.extra['trl_version']} GRPOTrainer (dapo, β=0) ({shape.describe()})",
        f"{time_ratio:.2f}x TRL's time; {mem:.2f}x its peak memory; abs Δloss {diff:.1e}",
        "≤ 0.8x time, ≤ 0.5x memory, ≤ 1e-5",
        met,
        [
            f"ours {_ms(ours)}, peak +{ours.peak_extra_mb:.0f} MB, loss {ours.extra['loss']:.7f}",
            f"TRL {_ms(theirs)}, peak +{theirs.peak_extra_mb:.0f} MB, "
            f"loss {theirs.extra['loss']:.7f}",
        ],
    )


def row_mfu(ctx: Context) -> RowResult:
    shapes = _shapes(ctx.quick)
    samples, length = (2, 32) if ctx.quick else (2, 512)
    results = {}
    for name in ("lm_head", "decoder"):
        shape = shapes[name]
        params = {
            **ctx.model(shape),
            "samples": samples,
            "length": length,
            "reps": 1 if ctx.quick else 2,
            "warmup": 1,
        }
        m = ctx.run("mfu", params)
        rate = m.extra["flops"] / m.median
        peak = statistics.median(m.extra["matmul_peaks"])
        results[name] = (rate / peak, rate, peak, shape)
    frac, rate, peak, shape = results["lm_head"]
    dfrac, drate, _, dshape = results["decoder"]
    return RowResult(
        3,
        "training step FLOP/s ÷ measured fp32 matmul peak (forward-backward + optim-step)",
        f"{frac:.2f} lm_head-dominated; {dfrac:.2f} decoder-dominated",
        "≥ 0.35 (lm_head-dominated)",
        _ok(frac, 0.35, True),
        [
            f"lm_head-dominated ({shape.describe()}): {rate / 1e9:.1f} GFLOP/s of "
            f"{peak / 1e9:.1f} GFLOP/s matmul peak",
            f"decoder-dominated ({dshape.describe()}): {drate / 1e9:.1f} GFLOP/s",
            f"{samples} x {length} tokens; model FLOPs 6·N·T + attention, recompute not counted",
        ],
    )


def row_packing(ctx: Context) -> RowResult:
    shape = _shapes(ctx.quick)["packing"]
    batch: dict[str, Any] = (
        {"seed": 1, "n": 4, "prompt": [1, 1], "completion": [4, 48]}
        if ctx.quick
        else {"seed": 1, "n": 16, "prompt": [1, 1], "completion": [32, 1024]}
    )
    base = {
        **ctx.model(shape),
        "batch": batch,
        "reps": 1 if ctx.quick else 3,
        "row_tokens": 2048,
    }
    packed = ctx.run("packing", {**base, "layout": "packed"})
    masked = ctx.run("packing", {**base, "layout": "packed_mask", "reps": 1, "warmup": 0})
    padded = ctx.run("packing", {**base, "layout": "padded"})
    tokens = packed.extra["tokens"]
    ratio = padded.median / packed.median

    def rate(m: Measurement) -> str:
        return f"{tokens / m.median:.0f} tok/s ({_ms(m)})"

    return RowResult(
        4,
        f"mixed lengths ({batch['n']} samples, {batch['completion'][0]}–"
        f"{batch['completion'][1]} tokens, {tokens} total): packed vs padded tokens/s "
        f"({shape.describe()})",
        f"{ratio:.2f}x",
        "≥ 1.5x",
        _ok(ratio, 1.5, True),
        [
            f"packed, varlen `packed_sdpa` {rate(packed)}; padded, 2D mask {rate(padded)}",
            f"packed rows of {base['row_tokens']} with the dense block-diagonal mask (what "
            f"the previous session path): {rate(masked)}, {padded.median / masked.median:.2f}x "
            "padded",
        ],
    )


def row_sync(ctx: Context) -> RowResult:
    shape = _shapes(ctx.quick)["sync"]
    params = {
        **ctx.model(shape),
        "rank": 8 if ctx.quick else 32,
        "reps": 3 if ctx.quick else 20,
    }
    m = ctx.run("lora_sync", params)
    copy = statistics.median(m.extra["copy_times"])
    ratio = m.median / copy
    return RowResult(
        5,
        f"LoRA weights-sync ÷ copying the adapter tensors (rank {params['rank']}, "
        f"{m.extra['adapter_mb']:.1f} MB, {shape.describe()})",
        f"{ratio:.2f}x",
        "≤ 2x",
        _ok(ratio, 2, False),
        [f"weights-sync {m.median * 1e3:.2f} ms; copy {copy * 1e3:.2f} ms"],
    )


def row_checkpoint(ctx: Context) -> RowResult:
    shape = _shapes(ctx.quick)["ckpt"]
    storage = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=ctx.workdir))
    params = {
        **ctx.model(shape),
        "storage": str(storage),
        "reps": 1 if ctx.quick else 9,
    }
    m = ctx.run("checkpoint", params)
    raw = statistics.median(m.extra["raw_times"])
    baseline = statistics.median(m.extra["baseline_times"])
    mb = m.extra["bytes"] / 2**20
    ratio = raw / m.median
    details = [
        f"save_training_checkpoint (save_tensors from the live tensors under the lock, "
        f"fsync ∥ sha256 per file as it closes, manifest, rename, catalogue) "
        f"{mb / m.median:.0f} MB/s; raw write + fsync "
        f"{mb / raw:.0f} MB/s; sha256 on this machine during the run: "
        f"{m.extra['sha256_mb_s']:.0f} MB/s",
        f"baseline, the path before (a clone of every tensor under the lock, safetensors "
        f"save_file, then fsync ∥ sha256 of all files) {mb / baseline:.0f} MB/s: ratio "
        f"{raw / baseline:.2f}",
    ]
    for arm, phases in m.extra.get("phases", {}).items():
        parts = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in phases.items() if k != "total")
        details.append(f"profile, {arm} (median ms): {parts}; total {phases['total'] * 1e3:.0f}")
    return RowResult(
        6,
        f"training checkpoint write MB/s ÷ raw sequential write MB/s ({mb:.0f} MB: full "
        f"weights + AdamW, {shape.describe()})",
        f"{ratio:.2f}",
        "≥ 0.5",
        _ok(ratio, 0.5, True),
        details,
    )


def row_http(ctx: Context) -> RowResult:
    try:
        import together  # noqa: F401
    except ImportError:
        return RowResult(7, "SDK over HTTP vs in-process", "together not installed", "", None)
    shape = _shapes(ctx.quick)["http"]
    batch: dict[str, Any] = (
        {"seed": 2, "n": 2, "prompt": [1, 1], "completion": [16, 16]}
        if ctx.quick
        else {"seed": 2, "n": 8, "prompt": [1, 1], "completion": [512, 512]}
    )
    base = {
        **ctx.model(shape),
        "batch": batch,
        "rank": 16,
        "reps": 1 if ctx.quick else 2,
    }
    local = ctx.run("fb_inprocess", base)
    remote = run_child("fb_http", base) if not ctx.inprocess else ctx.run("fb_http", base)
    ratio = remote.median / local.median
    return RowResult(
        7,
        f"forward-backward via the together SDK over HTTP ÷ in-process ({batch['n']} x "
        f"{batch['completion'][0]} tokens, LoRA rank 16, {shape.describe()})",
        f"{ratio:.2f}x",
        "≤ 1.1x",
        _ok(ratio, 1.1, False),
        [f"HTTP {_ms(remote)}; in-process {_ms(local)}"],
    )


def row_memory(ctx: Context) -> RowResult:
    shape = _shapes(ctx.quick)["memory"]
    batch: dict[str, Any] = (
        {"seed": 3, "n": 2, "prompt": [1, 1], "completion": [16, 16]}
        if ctx.quick
        else {"seed": 3, "n": 4, "prompt": [1, 1], "completion": [128, 128]}
    )
    base = {
        **ctx.model(shape),
        "batch": batch,
        "rank": 32,
        "reps": 1,
    }
    lora = ctx.run("train_memory", {**base, "kind": "lora"})
    full = ctx.run("train_memory", {**base, "kind": "full"})
    ratio = lora.peak_total_mb / full.peak_total_mb
    return RowResult(
        8,
        f"peak memory of forward-backward + optim-step, LoRA rank 32 ÷ full weights "
        f"({shape.describe()}, {batch['n']} x {batch['completion'][0]} tokens)",
        f"{ratio:.2f}",
        "≤ 0.6",
        _ok(ratio, 0.6, False),
        [f"LoRA {lora.peak_total_mb:.0f} MB; full {full.peak_total_mb:.0f} MB (above imports)"],
    )


ROWS: dict[int, Callable[[Context], RowResult]] = {
    1: row_head,
    2: row_grpo,
    3: row_mfu,
    4: row_packing,
    5: row_sync,
    6: row_checkpoint,
    7: row_http,
    8: row_memory,
}
