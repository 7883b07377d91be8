"""In-process decode throughput, and the host transfers of each decode step.

    python scripts/bench_decode.py --baseline                      # CPU, tiny shape, both arms
    python scripts/bench_decode.py --device cuda --dtype bfloat16 --shape qwen3-0.6b \\
        --batches 1,8,64 --tokens 512 --json out/decode.json       # the GPU row

A Qwen3-shaped model with random weights is built from a config on the device (`tiny`: the
Qwen3 vocabulary, hidden 64, 2 layers; `qwen3-0.6b`: Qwen3-0.6B's shape, as in
`scripts/bench_gpu.py`), with FlashAttention on CUDA when `flash_attn` is installed and
`packed_sdpa` otherwise, as the worker loads models. For each batch size, one job of that many
distinct prompts (`--prompt-tokens` each, so no row is padded) generates `--tokens` new tokens
through `trainer.compute.sampler.generate` (temperature 1, no EOS: every row runs to the end).
tokens/s = batch x tokens / wall time of the generation (prefill included), median of
`--repeats` runs after a warm-up. `--baseline` also runs the loop as it was before it stayed on
the device (`benchmarks/decode_baseline.py`), arms alternating run by run.

Transfers per step come from a shorter run apart (`--count-tokens`): the host crossings
counted by `benchmarks/host_transfers.py` (profiled: `torch.multinomial`'s inner checks
included), per decode step (a decode forward and a choice; the prefill's are in the JSON
apart); on CUDA also the synchronisations `torch.cuda.set_sync_debug_mode` reports over the
whole generation, per step. Prints a table; `--json PATH` writes the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.decode_baseline import old_loop  # noqa: E402
from benchmarks.host_transfers import HostTransfers  # noqa: E402
from benchmarks.shapes import ModelShape, qwen3_config  # noqa: E402
from trainer.compute import sampler  # noqa: E402
from trainer.compute.attention import PACKED_SDPA, use_packed_sdpa  # noqa: E402
from trainer.contract.specs import SamplingParams  # noqa: E402

SHAPES = {
    "tiny": ModelShape(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16),
    "qwen3-0.6b": ModelShape(  # as scripts/bench_gpu.py's QWEN3_06B
        hidden=1024, intermediate=3072, layers=28, heads=16, kv_heads=8, head_dim=128
    ),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ARMS: dict[str, Callable[[], contextlib.AbstractContextManager[Any]]] = {
    "device": contextlib.nullcontext,
    "baseline": old_loop,
}


def build(shape: ModelShape, device: torch.device, dtype: torch.dtype) -> tuple[Any, str]:
    from transformers import AutoModelForCausalLM

    attn = "sdpa"
    if device.type == "cuda":
        with contextlib.suppress(ImportError):
            import flash_attn  # noqa: F401

            attn = "flash_attention_2"
    config = qwen3_config(shape, max_position_embeddings=40960)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    if attn == "sdpa":
        use_packed_sdpa(model)
        attn = PACKED_SDPA
    return model.eval(), attn


def job(batch: int, tokens: int, prompt_tokens: int, vocab: int) -> sampler.DecodeJob:
    gen = torch.Generator().manual_seed(batch)
    prompts = torch.randint(2, vocab, (batch, prompt_tokens), generator=gen).tolist()
    params = SamplingParams(max_tokens=tokens, temperature=1.0, seed=batch)
    return sampler.DecodeJob(
        prompts=prompts, num_samples=1, params=params, eos_ids=set(), seed=batch
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def timed(model: Any, jobs: list[sampler.DecodeJob], device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    sampler.generate(model, jobs)
    sync(device)
    return time.perf_counter() - start


@contextlib.contextmanager
def cuda_syncs(device: torch.device) -> Iterator[list[int]]:
    """The synchronisations CUDA reports meanwhile (`set_sync_debug_mode`), counted."""
    count = [0]
    if device.type != "cuda":
        yield count
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield count
        finally:
            torch.cuda.set_sync_debug_mode(0)
    count[0] = sum(1 for w in caught if "synchroniz" in str(w.message))


@torch.no_grad()
def transfers_per_step(model: Any, jobs: list[sampler.DecodeJob], device: torch.device) -> dict:
    """Host crossings (and CUDA syncs) per decode step in one generation of `jobs`."""
    with HostTransfers(profiled=True) as transfers:
        sampler.generate(model, jobs, forward=transfers.stepping(model))
    with cuda_syncs(device) as syncs:
        sampler.generate(model, jobs)
    decode = transfers.per_step[2:]  # each a decode forward and a choice; [1]: the prefill's
    steps = max(transfers.steps, 1)
    return {
        "transfers_per_step": sum(decode) / max(len(decode), 1),
        "prefill_transfers": transfers.per_step[1],
        "cuda_syncs_per_step": syncs[0] / steps if device.type == "cuda" else None,
        "transfer_kinds": dict(transfers.kinds),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    device, dtype, shape = torch.device(args.device), DTYPES[args.dtype], SHAPES[args.shape]
    model, attn = build(shape, device, dtype)
    arms = ["device", "baseline"] if args.baseline else ["device"]
    rows = []
    for batch in args.batches:
        times: dict[str, list[float]] = {arm: [] for arm in arms}
        counts: dict[str, dict] = {}
        for arm in arms:
            with ARMS[arm]():
                timed(model, [job(batch, 4, args.prompt_tokens, shape.vocab)], device)  # warm-up
                short = [job(batch, args.count_tokens, args.prompt_tokens, shape.vocab)]
                counts[arm] = transfers_per_step(model, short, device)
        for _ in range(args.repeats):
            for arm in arms:
                with ARMS[arm]():
                    jobs = [job(batch, args.tokens, args.prompt_tokens, shape.vocab)]
                    times[arm].append(timed(model, jobs, device))
        for arm in arms:
            seconds = statistics.median(times[arm])
            rows.append(
                {
                    "arm": arm,
                    "batch": batch,
                    "tokens": args.tokens,
                    "seconds": seconds,
                    "tokens_per_s": batch * args.tokens / seconds,
                    "step_ms": seconds / args.tokens * 1e3,
                    **counts[arm],
                }
            )
            print(_row(rows[-1], rows), flush=True)
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype,
        "shape": args.shape,
        "shape_detail": shape.describe(),
        "attention": attn,
        "prompt_tokens": args.prompt_tokens,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "rows": rows,
    }


def _row(row: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    mine = [r for r in rows if r["arm"] == "device" and r["batch"] == row["batch"]]
    ratio = ""
    if row["arm"] == "baseline" and mine:
        ratio = f"{mine[0]['tokens_per_s'] / row['tokens_per_s']:.2f}x"
    syncs = row["cuda_syncs_per_step"]
    return (
        f"| {row['arm']} | {row['batch']} | {row['tokens']} | {row['tokens_per_s']:,.0f} | "
        f"{row['step_ms']:.2f} | {row['transfers_per_step']:.2f} | "
        f"{'-' if syncs is None else f'{syncs:.2f}'} | {ratio} |"
    )


def decode_parser(doc: str, tokens: int, tokens_help: str) -> argparse.ArgumentParser:
    """The arguments every decode benchmark takes: the model (device, dtype, shape), the batch
    sizes, new tokens per row, repeats, CPU threads and the JSON output."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    parser.add_argument("--shape", choices=list(SHAPES), default="tiny")
    parser.add_argument(
        "--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 8, 64]
    )
    parser.add_argument("--tokens", type=int, default=tokens, help=tokens_help)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--json", type=Path, default=None)
    return parser


def parse_decode_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> Any:
    """`parser`'s arguments, the torch CPU threads set as asked."""
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def main(argv: list[str] | None = None) -> None:
    parser = decode_parser(__doc__, 64, "new tokens per row")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--count-tokens", type=int, default=16, help="tokens of the counting run")
    parser.add_argument("--baseline", action="store_true", help="also the old loop, side by side")
    args = parse_decode_args(parser, argv)
    print(
        "| arm | batch | new tokens | tokens/s | ms/step | host transfers/step | "
        "CUDA syncs/step | device ÷ baseline |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    figures = run(args)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
