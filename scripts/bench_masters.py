"""An AdamW step on bf16 full weights, with fp32 masters (the default) ÷ without; and what
widening one backward's bf16 gradients into the fp32 sums costs (`optim.accumulate_`, after
every micro-batch with masters).

    python scripts/bench_masters.py --layers 28 --device cuda
    python scripts/bench_masters.py --layers 4 --device cpu --steps 3

The tensors have Qwen3-0.6B's names and shapes (`bench_muon.shapes`, full weights), in bf16,
with random bf16 gradients; no model is built (a step's cost depends only on those tensors).
Both arms run the engine's own step (`optim.adamw_step`, global clip included), alternating,
the masters' arm on gradients widened first (timed apart), and the median of `--steps` timed
steps after `--warmup` is reported, with the bytes each arm's optimizer state holds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.bench_muon import _params as fp32
from scripts.bench_muon import _sync, shapes
from trainer.compute import optim
from trainer.compute.placement import Solo
from trainer.contract.specs import AdamParams


def _params(spec: dict[str, tuple[int, ...]], device: str) -> list[torch.nn.Parameter]:
    """`bench_muon`'s weights, in bf16."""
    return [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in fp32(spec, device).values()]


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(
        v.numel() * v.element_size()
        for state in opt.state.values()
        for v in state.values()
        if torch.is_tensor(v)
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()
    spec = shapes("full", args.layers, 0)
    arms = {
        "plain": _params(spec, args.device),
        "masters": _params(spec, args.device),
    }
    opts = {
        "plain": optim.new_adamw(arms["plain"], masters=False),
        "masters": optim.new_adamw(arms["masters"], masters=True),
    }
    adam = AdamParams(learning_rate=1e-5)
    times: dict[str, list[float]] = {arm: [] for arm in [*arms, "widen"]}
    for step in range(args.warmup + args.steps):
        for arm, params in arms.items():
            gen = torch.Generator(device=args.device).manual_seed(step)
            for p in params:
                p.grad = torch.randn(p.shape, device=p.device, generator=gen).to(torch.bfloat16)
            if arm == "masters":  # as the pass does after a backward
                _sync(args.device)
                start = time.perf_counter()
                optim.accumulate_(opts[arm], params)
                _sync(args.device)
                if step >= args.warmup:
                    times["widen"].append(time.perf_counter() - start)
            _sync(args.device)
            start = time.perf_counter()
            optim.adamw_step(opts[arm], params, adam, Solo())
            _sync(args.device)
            if step >= args.warmup:
                times[arm].append(time.perf_counter() - start)
    plain, masters = statistics.median(times["plain"]), statistics.median(times["masters"])
    numel = sum(p.numel() for p in arms["plain"])
    figures = {
        "layers": args.layers,
        "numel": numel,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "plain_ms": plain * 1e3,
        "masters_ms": masters * 1e3,
        "ratio": masters / plain,
        "widen_ms": statistics.median(times["widen"]) * 1e3,
        "plain_state_gib": _state_bytes(opts["plain"]) / 2**30,
        "masters_state_gib": _state_bytes(opts["masters"]) / 2**30,
    }
    print(row(figures))
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


def row(f: dict) -> str:
    """The figures as a BENCHMARKS.md row."""
    return (
        f"| full bf16, {f['layers']} layers | {f['numel'] / 1e6:.1f} M | {f['device']} "
        f"| {f['plain_ms']:.1f} ms | {f['masters_ms']:.1f} ms | **{f['ratio']:.2f}×** "
        f"| {f['widen_ms']:.1f} ms | {f['plain_state_gib']:.2f} GiB "
        f"| {f['masters_state_gib']:.2f} GiB |"
    )


if __name__ == "__main__":
    raise SystemExit(main())
