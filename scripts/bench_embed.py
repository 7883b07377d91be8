"""An InfoNCE embedding call (`contrastive_loss`, docs/semantics.md §27) on a LoRA session: in one
micro-batch (one forward, one backward) ÷ split into several (a forward without gradients, then
each micro-batch's forward and backward again: `embed_pass`'s two-pass backward), beside a
cross-entropy forward-backward over the same tokens.

    python scripts/bench_embed.py --layers 2 --calls 5
    python scripts/bench_embed.py --layers 28 --device cuda --dtype bfloat16

The model has Qwen3-0.6B's layer shapes (hidden 1,024, 16 heads of 128, 8 KV heads, MLP 3,072)
with `--layers` layers and a 4,096-token vocabulary (an embedding call never runs the head),
random weights, saved and loaded as a worker does (`ModelResource`). The call is `--pairs`
(query, positive) pairs of `--tokens` tokens each; "split" sets `token_budget` to a quarter of
the call. The arms alternate call by call on one resource; medians after one warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.bench_merge import _samples as cross_entropy_samples
from trainer.checkpoint.store import CheckpointStore
from trainer.contract.embeddings import EmbeddingObjective
from trainer.contract.options import EngineOptions
from trainer.contract.specs import (
    LoraConfig,
    LossConfig,
    ModelEntry,
    ResourceSpec,
    Sample,
    SessionSpec,
)
from trainer.engine.resource import ModelResource
from trainer.tiny import TinySpec, save_model


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()
    shape = TinySpec(
        vocab=4096, hidden=1024, intermediate=3072, layers=args.layers, heads=16, kv_heads=8,
        head_dim=128, max_positions=4096,
    )  # fmt: skip
    tmp = Path(tempfile.mkdtemp(prefix="bench_embed_"))
    model_dir = save_model(shape, tmp / "model")
    entry = ModelEntry(name="m", location=str(model_dir), max_seq_length=4096, dtype=args.dtype)  # type: ignore[arg-type]
    spec = ResourceSpec.model_validate({"base_model": "m", "lora_enabled": True})
    count = 2 * args.pairs
    total = count * args.tokens
    arms = {"one": total, "split": max(args.tokens, total // 4)}
    sessions = {}
    for name, budget in arms.items():
        options = EngineOptions(token_budget=budget, row_tokens=min(budget, 2048), merge=False)
        resource = ModelResource(
            entry, spec, CheckpointStore(tmp / name), device=args.device, options=options
        )
        lora = LoraConfig(rank=16, alpha=32, seed=0)
        sessions[name] = resource.create_session("s", SessionSpec(lora_config=lora))
    ce = cross_entropy_samples(1, count, args.tokens, shape.vocab)
    texts = [Sample(model_input=s.model_input) for s in ce]  # the same tokens, no loss inputs
    objective = EmbeddingObjective(
        output="contrastive_loss", num_queries=args.pairs, temperature=0.05, pooling="last"
    )

    def sync() -> None:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    def timed(name: str) -> float:
        session = sessions[name.split(":")[0]]
        sync()
        start = time.perf_counter()
        if name.endswith(":ce"):
            session.forward_backward(LossConfig(type="cross_entropy"), ce)
        else:
            session.embedding_forward_backward(texts, objective)
        sync()
        session.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    names = ["one", "split", "one:ce"]
    times: dict[str, list[float]] = {name: [] for name in names}
    for call in range(args.calls + 1):
        for name in names:
            took = timed(name)
            if call:  # the first round warms up
                times[name].append(took)
    ms = {name: 1000 * statistics.median(values) for name, values in times.items()}
    figures = {
        "layers": args.layers,
        "sequences": count,
        "tokens": total,
        "device": args.device,
        "dtype": args.dtype,
        "one_ms": round(ms["one"], 1),
        "split_ms": round(ms["split"], 1),
        "split_over_one": round(ms["split"] / ms["one"], 3),
        "cross_entropy_ms": round(ms["one:ce"], 1),
        "one_over_cross_entropy": round(ms["one"] / ms["one:ce"], 3),
    }
    print(json.dumps(figures))
    if args.json is not None:
        args.json.write_text(json.dumps(figures) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
