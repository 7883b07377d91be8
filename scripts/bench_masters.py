"""An AdamW step on bf16 full weights, with fp32 masters (the default) ÷ without.

    python scripts/bench_masters.py --layers 28 --device cuda
    python scripts/bench_masters.py --layers 4 --device cpu --steps 3

The tensors have Qwen3-0.6B's names and shapes (`bench_muon.shapes`, full weights), in bf16,
with random bf16 gradients; no model is built (a step's cost depends only on those tensors).
Both arms run the engine's own step (`optim.adamw_step`, global clip included), alternating,
and the median of `--steps` timed steps after `--warmup` is reported, with the bytes each
arm's optimizer state holds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.bench_muon import _sync, shapes
from trainer.compute import optim
from trainer.compute.placement import Solo
from trainer.contract.specs import AdamParams


def _params(spec: dict[str, tuple[int, ...]], device: str) -> list[torch.nn.Parameter]:
    gen = torch.Generator(device=device).manual_seed(0)
    return [
        torch.nn.Parameter((torch.randn(s, device=device, generator=gen) * 0.02).to(torch.bfloat16))
        for s in spec.values()
    ]


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
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    for step in range(args.warmup + args.steps):
        for arm, params in arms.items():
            gen = torch.Generator(device=args.device).manual_seed(step)
            for p in params:
                p.grad = torch.randn(p.shape, device=p.device, generator=gen).to(torch.bfloat16)
            _sync(args.device)
            start = time.perf_counter()
            optim.adamw_step(opts[arm], params, adam, Solo())
            _sync(args.device)
            if step >= args.warmup:
                times[arm].append(time.perf_counter() - start)
    plain, masters = statistics.median(times["plain"]), statistics.median(times["masters"])
    numel = sum(p.numel() for p in arms["plain"])
    print(
        f"| full bf16, {args.layers} layers | {numel / 1e6:.1f} M | {args.device} "
        f"| {plain * 1e3:.1f} ms | {masters * 1e3:.1f} ms | **{masters / plain:.2f}×** "
        f"| {_state_bytes(opts['plain']) / 2**30:.2f} GiB "
        f"| {_state_bytes(opts['masters']) / 2**30:.2f} GiB |"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
