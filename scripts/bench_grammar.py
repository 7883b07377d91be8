"""Constrained decoding's cost: the decode loop with and without a grammar, side by side.

    python scripts/bench_grammar.py                                # CPU, tiny shape
    python scripts/bench_grammar.py --device cuda --dtype bfloat16 --shape qwen3-0.6b \\
        --batches 1,8,64 --tokens 256 --json out/grammar.json      # the GPU row

The model is `scripts/bench_decode.py`'s (random weights, the Qwen3 vocabulary of 151,936
ids). The tokenizer is a byte-level BPE of 32,000 tokens trained here on synthetic words (no
download), read by llguidance over the model's whole vocabulary, as a real Qwen3 tokenizer
would be. For each batch size, one job of that many prompts generates up to `--tokens` tokens
at temperature 1 through `trainer.compute.sampler.generate`, in two arms, alternating run by
run: `plain`, and `grammar` (a JSON Schema: an object holding a list of strings, which the
rows keep writing). tokens/s counts the tokens generated (a row may finish early), median of
`--repeats` runs after a warm-up; `host transfers/step` is counted in a shorter run apart
(`benchmarks/host_transfers.py`). Prints a table; `--json PATH` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.host_transfers import HostTransfers  # noqa: E402
from scripts.bench_decode import (  # noqa: E402
    DTYPES,
    SHAPES,
    build,
    decode_parser,
    parse_decode_args,
    sync,
)
from trainer.compute import sampler  # noqa: E402
from trainer.compute.grammar import Compiled  # noqa: E402
from trainer.contract.grammar import OutputGrammar  # noqa: E402
from trainer.contract.specs import SamplingParams  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string"}}},
    "required": ["items"],
}
EOS = 1


def tokenizer() -> Any:
    """A byte-level BPE of 32,000 tokens over synthetic words (deterministic)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choices(letters, k=rng.randint(2, 9))) for _ in range(40_000)]
    lines = [" ".join(rng.sample(words, 50)) for _ in range(20_000)]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        lines, vocab_size=32_000, special_tokens=["<|endoftext|>", "<|im_end|>"]
    )
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|im_end|>")


def job(batch: int, tokens: int, vocab: int, compiled: Compiled | None) -> sampler.DecodeJob:
    gen = torch.Generator().manual_seed(batch)
    prompts = torch.randint(2, vocab, (batch, 16), generator=gen).tolist()
    params = SamplingParams(max_tokens=tokens, temperature=1.0, seed=batch)
    grammar = None if compiled is None else compiled.rows(batch)
    return sampler.DecodeJob(prompts, 1, params, {EOS}, batch, grammar=grammar)


@torch.no_grad()
def timed(model: Any, made: sampler.DecodeJob, device: torch.device) -> tuple[float, int]:
    sync(device)
    start = time.perf_counter()
    groups = sampler.generate(model, [made])
    sync(device)
    return time.perf_counter() - start, sum(len(s.tokens) for g in groups[0] for s in g)


@torch.no_grad()
def transfers_per_step(model: Any, made: sampler.DecodeJob) -> float:
    with HostTransfers(profiled=True) as transfers:
        sampler.generate(model, [made], forward=transfers.stepping(model))
    decode = transfers.per_step[2:]
    return sum(decode) / max(len(decode), 1)


def run(args: argparse.Namespace) -> dict[str, Any]:
    device, dtype, shape = torch.device(args.device), DTYPES[args.dtype], SHAPES[args.shape]
    model, attn = build(shape, device, dtype)
    started = time.perf_counter()
    compiled = Compiled(
        OutputGrammar("json_schema", json.dumps(SCHEMA)), tokenizer(), shape.vocab, {EOS}
    )
    setup_s = time.perf_counter() - started
    arms: dict[str, Compiled | None] = {"plain": None, "grammar": compiled}
    rows = []
    for batch in args.batches:
        counts = {
            arm: transfers_per_step(model, job(batch, 8, shape.vocab, c)) for arm, c in arms.items()
        }
        times: dict[str, list[float]] = {arm: [] for arm in arms}
        made: dict[str, list[int]] = {arm: [] for arm in arms}
        for c in arms.values():
            timed(model, job(batch, 4, shape.vocab, c), device)  # warm-up
        for _ in range(args.repeats):
            for arm, c in arms.items():
                seconds, tokens = timed(model, job(batch, args.tokens, shape.vocab, c), device)
                times[arm].append(seconds)
                made[arm].append(tokens)
        for arm in arms:
            seconds, tokens = statistics.median(times[arm]), statistics.median(made[arm])
            rows.append(
                {
                    "arm": arm,
                    "batch": batch,
                    "tokens": tokens,
                    "seconds": seconds,
                    "tokens_per_s": tokens / seconds,
                    "transfers_per_step": counts[arm],
                }
            )
            print(_row(rows[-1], rows), flush=True)
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype,
        "shape": args.shape,
        "attention": attn,
        "grammar_setup_s": setup_s,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "rows": rows,
    }


def _row(row: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    plain = [r for r in rows if r["arm"] == "plain" and r["batch"] == row["batch"]]
    ratio = ""
    if row["arm"] == "grammar" and plain:
        ratio = f"{row['tokens_per_s'] / plain[0]['tokens_per_s']:.2f}x"
    return (
        f"| {row['arm']} | {row['batch']} | {row['tokens']:.0f} | {row['tokens_per_s']:,.0f} | "
        f"{row['transfers_per_step']:.2f} | {ratio} |"
    )


def main(argv: list[str] | None = None) -> None:
    parser = decode_parser(__doc__, 32, "new tokens per row, at most")
    args = parse_decode_args(parser, argv)
    print("| arm | batch | tokens made | tokens/s | host transfers/step | grammar ÷ plain |")
    print("|---|---:|---:|---:|---:|---:|", flush=True)
    figures = run(args)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
