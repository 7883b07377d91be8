"""What exactness costs per model family: forward-backward through the engine on each family's
chosen path, beside a plain Qwen3 of about the same size on the packed path, in one run.

    python -m benchmarks.families [--reps 5] [--samples 16]

Each arm: a full-weight session on a random model (hidden 256, 4 layers, vocabulary 4096;
sliding windows of 64 tokens), one warm-up call, then the median of `--reps` cross-entropy
forward-backward calls of `--samples` samples of 64–256 tokens (the same samples for every
arm). Prints a markdown table: tokens per second, the ratio to Qwen3 packed, and the load-time
self-check's seconds (docs/semantics.md §20).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.engine_setup import ce_samples, make_resource, make_session
from benchmarks.shapes import RLBatch
from trainer.compute import architecture
from trainer.compute.architecture import ROWS
from trainer.tiny_families import family_config

SIZE = {"hidden_size": 256, "intermediate_size": 768, "vocab_size": 4096}
WINDOW = 64


def _config(family: str) -> Any:
    config = family_config(family)
    text = config.get_text_config()
    for key, value in SIZE.items():
        setattr(text, key, value)
    text.num_hidden_layers = 4
    if getattr(text, "sliding_window", None):
        text.sliding_window = WINDOW
    types = getattr(text, "layer_types", None)
    if types:
        kinds = list(dict.fromkeys(types))  # every kind of the family, the last one last
        text.layer_types = [kinds[0]] * 3 + [kinds[-1]]
    if hasattr(text, "moe_intermediate_size"):
        text.moe_intermediate_size = 192
    if hasattr(text, "intermediate_size_mlp"):
        text.intermediate_size_mlp = 768
    return config


def _save(family: str, root: Path) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(family), dtype=torch.float32)
    out = root / family
    model.save_pretrained(out)
    return out


def _samples(n: int) -> list[Any]:
    gen = torch.Generator().manual_seed(0)
    prompts, completions = [], []
    for _ in range(n):
        length = int(torch.randint(64, 257, (), generator=gen))
        seq = torch.randint(2, SIZE["vocab_size"], (length + 1,), generator=gen).tolist()
        prompts.append(seq[:1])
        completions.append(seq[1:])
    return ce_samples(RLBatch(prompts=prompts, completions=completions, advantages_B=[0.0] * n))


def _arm(model_dir: Path, storage: Path, samples: list[Any], reps: int, rows: bool) -> dict:
    from trainer.contract.specs import LossConfig

    resource = make_resource(str(model_dir), lora=False, storage=str(storage))
    arch = architecture.of(resource.model)
    if rows and arch.layout != ROWS:
        architecture.keep(resource.model, arch.chosen(ROWS, {}, arch.check_seconds))
    session = make_session(resource)
    loss = LossConfig.model_validate({"type": "cross_entropy"})
    session.forward_backward(loss, samples)  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        session.forward_backward(loss, samples)
        times.append(time.perf_counter() - start)
    path = architecture.of(resource.model).path()
    resource.close()
    return {
        "path": path,
        "seconds": statistics.median(times),
        "check": arch.check_seconds,
    }


ARMS = [
    ("qwen3", False),
    ("qwen3", True),
    ("qwen3_5", False),
    ("qwen3_next", False),
    ("gemma3", False),
    ("mistral", False),
    ("gpt_oss", False),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--samples", type=int, default=16)
    args = parser.parse_args()
    samples = _samples(args.samples)
    tokens = sum(len(s.model_input.tokens) for s in samples)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for family, rows in ARMS:
            model_dir = root / family if (root / family).exists() else _save(family, root)
            found = _arm(model_dir, root / f"store-{family}-{rows}", samples, args.reps, rows)
            results.append((family + (" (forced rows)" if rows else ""), found))
    base = results[0][1]["seconds"]
    print(f"{args.samples} samples, {tokens} tokens, median of {args.reps}")
    print("| family | trainer path | tok/s | time vs Qwen3 packed | self-check at load |")
    print("|---|---|---|---|---|")
    for name, r in results:
        print(
            f"| {name} | {r['path']} | {tokens / r['seconds']:.0f} | "
            f"{r['seconds'] / base:.2f}x | {r['check']:.2f} s |"
        )


if __name__ == "__main__":
    main()
