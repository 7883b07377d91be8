"""Merged multi-adapter forward+backward (`trainer.compute.multilora.segmented`) vs one pass per
adapter.

    python scripts/bench_multilora.py                        # demo-sized tiny Qwen3, 8 x 4 x 32
    python scripts/bench_multilora.py --vocab 151936 --hidden 1024 --layers 2 --reps 5

The model is the demo's tiny model (`trainer demo`'s built-in recipe: Qwen3-shaped, hidden 64,
2 layers, vocabulary 16) unless overridden; each of `--adapters` LoRA adapters is built as a
session's (`LoraPolicy`, rank 32, alpha 64, head included) with random B matrices, and owns
`--samples` packed samples of `--tokens` tokens. One *merged* step is the decoder over one
packed row of every sample under `segmented` (each adapter's samples one run), then per adapter
the engine's chunked head (`token_logprobs`, that adapter's head LoRA) and a next-token loss,
and one backward; one *solo* step is, per adapter, the same on its own samples with it active
(the way sessions take turns today). Steps alternate; the medians of `--reps` timed steps after
`--warmup` are reported, and the ratio solo / merged (above 1: merging is faster).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.compute.attention import use_packed_sdpa
from trainer.compute.logprobs import token_logprobs
from trainer.compute.multilora import Segment, segmented
from trainer.compute.policy import LoraPolicy, SharedPeft
from trainer.contract.specs import LoraConfig
from trainer.rl.config import Recipe
from trainer.tiny import TinySpec, build_model


def build(args: argparse.Namespace) -> tuple[Any, Any, list[str]]:
    spec: TinySpec = Recipe().model.tiny_spec()
    overrides = {"vocab": args.vocab, "hidden": args.hidden, "layers": args.layers}
    fields = {k: v for k, v in overrides.items() if v is not None}
    if "hidden" in fields:
        fields["intermediate"] = 2 * fields["hidden"]
    spec = TinySpec(**{**spec.__dict__, **fields})
    model = build_model(spec, seed=0)
    use_packed_sdpa(model)
    holder = SharedPeft()
    names = [f"s{i}" for i in range(args.adapters)]
    config = LoraConfig(rank=args.rank, alpha=2 * args.rank)
    for i, name in enumerate(names):
        LoraPolicy(model, holder, name, config, seed=i, with_generator=False)
    peft = holder.model
    with torch.no_grad():
        for pname, param in peft.named_parameters():
            if "lora_B" in pname:
                param.normal_(0.0, 0.05)
            param.requires_grad_("lora_" in pname)
    peft.train()
    return peft, peft.base_model.model, names


def packed(samples: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.cat(samples)[None],
        "position_ids": torch.cat([torch.arange(len(s)) for s in samples])[None],
    }


def loss_of(model: Any, hidden_N_H: torch.Tensor, ids: torch.Tensor, adapter: str) -> torch.Tensor:
    """Mean next-token loss through the engine's chunked head (`token_logprobs`), with the
    head's LoRA set to `adapter` (without touching which weights require grad)."""
    head = model.get_output_embeddings()
    saved = head._active_adapter
    head._active_adapter = [adapter]
    try:
        lp, _ = token_logprobs(hidden_N_H[:-1], head, ids[1:])
    finally:
        head._active_adapter = saved
    return -lp.mean()


def decoder(model: Any, samples: list[torch.Tensor]) -> torch.Tensor:
    hidden = model.get_decoder()(**packed(samples), use_cache=False).last_hidden_state
    return hidden.reshape(-1, hidden.shape[-1])


def merged_step(peft: Any, model: Any, names: list[str], data: dict[str, list]) -> None:
    rows = [s for name in names for s in data[name]]
    segments, start = [], 0
    for name in names:
        n = sum(len(s) for s in data[name])
        segments.append(Segment(name, start, start + n))
        start += n
    ids = torch.cat(rows)
    with segmented(peft, segments):
        hidden = decoder(model, rows)
    total = sum(
        loss_of(model, hidden[s.start : s.end], ids[s.start : s.end], str(s.adapter))
        for s in segments
    )
    assert isinstance(total, torch.Tensor)
    total.backward()
    peft.zero_grad(set_to_none=True)


def solo_step(peft: Any, model: Any, names: list[str], data: dict[str, list]) -> None:
    for name in names:
        peft.base_model.set_adapter(name)
        hidden = decoder(model, data[name])
        loss_of(model, hidden, torch.cat(data[name]), name).backward()
    peft.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as is)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    peft, model, names = build(args)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    data = {
        name: [torch.randint(0, vocab, (args.tokens,), generator=gen) for _ in range(args.samples)]
        for name in names
    }
    times: dict[str, list[float]] = {"merged": [], "solo": []}
    steps = {"merged": merged_step, "solo": solo_step}
    for rep in range(args.warmup + args.reps):
        for arm, step in steps.items():
            start = time.perf_counter()
            step(peft, model, names, data)
            if rep >= args.warmup:
                times[arm].append(time.perf_counter() - start)
    merged = statistics.median(times["merged"])
    solo = statistics.median(times["solo"])
    print(
        f"{args.adapters} adapters x {args.samples} x {args.tokens} tokens, vocab {vocab}, "
        f"hidden {model.config.hidden_size}, {model.config.num_hidden_layers} layers, "
        f"{torch.get_num_threads()} threads, median of {args.reps}"
    )
    print(f"merged (one pass)      {merged * 1e3:8.2f} ms")
    print(f"solo ({args.adapters} passes)       {solo * 1e3:8.2f} ms")
    print(f"ratio solo / merged    {solo / merged:8.2f}x")


if __name__ == "__main__":
    main()
