"""Merged vs one-at-a-time forward-backward across the LoRA sessions of one resource.

N sessions (default 8) each send R forward-backward calls of B samples x T tokens (default
4 x 32, cross entropy), side by side in one run on one model:
- merged: each session on its own thread, all calls of a round sent at once (`[engine] merge`
  on, the default window), as the worker's session queues send them;
- serial: the same calls one at a time on a resource with merging off.
Prints calls/s of each arm, the ratio, and the scheduler's counters.

    python scripts/bench_merge.py                       # the demo-sized model (H=64, L=2, V=16)
    python scripts/bench_merge.py --vocab 151936 --hidden 256 --rounds 3   # Qwen3's vocabulary
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.checkpoint.store import CheckpointStore
from trainer.contract.options import EngineOptions
from trainer.contract.specs import (
    LoraConfig,
    LossConfig,
    ModelEntry,
    ResourceSpec,
    Sample,
    SessionSpec,
    TensorData,
)
from trainer.engine.resource import ModelResource
from trainer.tiny import TinySpec, save_model

CE = LossConfig(type="cross_entropy")


def _samples(seed: int, n: int, tokens: int, vocab: int) -> list[Sample]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        seq = torch.randint(2, vocab, (tokens + 1,), generator=gen).tolist()
        out.append(
            Sample.model_validate(
                {
                    "model_input": {"chunks": [{"encoded_text": {"tokens": seq[:-1]}}]},
                    "loss_fn_inputs": {
                        "target_tokens": TensorData(data=seq[1:], dtype="int64"),
                        "weights": TensorData(data=[1.0] * tokens, dtype="float32"),
                    },
                }
            )
        )
    return out


def _resource(model: Path, storage: Path, options: EngineOptions, sessions: int) -> Any:
    entry = ModelEntry(name="m", location=str(model), max_seq_length=512, max_lora_rank=64)
    spec = ResourceSpec(base_model="m", lora_enabled=True, compute_config={})
    resource = ModelResource(entry, spec, CheckpointStore(storage), device="cpu", options=options)
    for i in range(sessions):
        resource.create_session(f"s{i}", SessionSpec(lora_config=LoraConfig(rank=8, seed=i)))
    return resource


def _run(resource: Any, batches: list[list[Sample]], rounds: int, merged: bool) -> float:
    sessions = list(resource.sessions.values())
    start = time.perf_counter()
    if not merged:
        for _ in range(rounds):
            for session, batch in zip(sessions, batches, strict=True):
                session.forward_backward(CE, batch)
        return time.perf_counter() - start
    barrier = threading.Barrier(len(sessions))

    def drive(session: Any, batch: list[Sample]) -> None:
        for _ in range(rounds):
            barrier.wait()
            session.forward_backward(CE, batch)

    threads = [threading.Thread(target=drive, args=pair) for pair in zip(sessions, batches)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp())
    spec = TinySpec(
        vocab=args.vocab,
        hidden=args.hidden,
        intermediate=2 * args.hidden,
        layers=args.layers,
        eos=None,
        bos=None,
        pad=None,
    )
    model = save_model(spec, tmp / "model")
    vocab = args.vocab
    batches = [_samples(i, args.samples, args.tokens, vocab) for i in range(args.sessions)]
    merged = _resource(model, tmp / "a", EngineOptions(), args.sessions)
    serial = _resource(model, tmp / "b", EngineOptions(merge=False), args.sessions)
    _run(merged, batches, 1, True)  # warm-up
    _run(serial, batches, 1, False)
    before = dict(merged.scheduler.counters())
    calls = args.sessions * args.rounds
    t_serial = _run(serial, batches, args.rounds, False)
    t_merged = _run(merged, batches, args.rounds, True)
    after = merged.scheduler.counters()
    counters = {k: after[k] - before[k] for k in ("passes", "merged_passes", "merged_items")}
    print(
        f"{args.sessions} sessions x {args.rounds} rounds of {args.samples}x{args.tokens} tokens, "
        f"H={args.hidden} L={args.layers} V={args.vocab}, torch threads {torch.get_num_threads()}"
    )
    print(f"serial: {calls / t_serial:.1f} calls/s ({t_serial:.2f} s)")
    print(f"merged: {calls / t_merged:.1f} calls/s ({t_merged:.2f} s)")
    print(f"merged / serial: {t_serial / t_merged:.2f}x  counters {counters}")


if __name__ == "__main__":
    main()
