"""Many LoRA sessions on one base, CPU: merged vs one call at a time, side by side.

    OMP_NUM_THREADS=1 python scripts/bench_sessions.py                # both models
    OMP_NUM_THREADS=1 python scripts/bench_sessions.py --only demo --rounds 40

8 LoRA sessions (rank 32) of one resource each send forward-backward calls of 4 x 32 tokens
(cross entropy). Merged: each session on its own thread, a round's calls sent at once, so the
scheduler (`[engine] merge`, default window) runs them as one pass; serial: the same calls one
at a time on a twin resource with merging off. The two arms alternate round by round in one
process; medians of the rounds' times (`run_merge` of `scripts/bench_gpu.py`, which runs the
same row on a GPU). Two models, Qwen3-shaped with random weights:
- demo: the demo's size (hidden 64, 2 layers, 4 heads, a 16-token vocabulary), where the
  per-pass cost dominates;
- qwen3-vocab: Qwen3's vocabulary of 151,936 (hidden 256, 2 layers), where the head's FLOPs do.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_gpu import run_merge

from trainer.tiny import TinySpec

SHAPES = {
    "demo": TinySpec(vocab=16, hidden=64, intermediate=128, layers=2, eos=None, bos=None, pad=None),
    "qwen3-vocab": TinySpec(
        vocab=151_936, hidden=256, intermediate=512, layers=2, eos=None, bos=None, pad=None
    ),
}
ROUNDS = {"demo": 30, "qwen3-vocab": 5}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=sorted(SHAPES))
    parser.add_argument("--rounds", type=int, help="rounds per arm (default: 30 demo, 5 vocab)")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--merge-window-ms", type=float, help="default: the engine's")
    args = parser.parse_args()
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    print(f"torch threads {torch.get_num_threads()} (OMP_NUM_THREADS={threads})")
    print(f"load at start {os.getloadavg()}")
    print(
        "| model | sessions x tokens/call | serial calls/s | merged calls/s | merged/serial |",
        end="",
    )
    print(" merged |")
    print("|---|---|---|---|---|---|")
    for name, shape in SHAPES.items():
        if args.only and name != args.only:
            continue
        rounds = args.rounds or ROUNDS[name]
        result = run_merge(
            shape,
            torch.device("cpu"),
            args.sessions,
            args.samples,
            args.tokens,
            rounds,
            args.lora_rank,
            args.merge_window_ms,
        )
        print(f"| {name} (V={shape.vocab:,} H={shape.hidden}), {rounds} rounds {result.row()}")
    print(f"load at end {os.getloadavg()}")


if __name__ == "__main__":
    main()
