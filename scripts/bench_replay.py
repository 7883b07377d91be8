"""The cost of routing replay: time per forward-backward with and without keys.

    python scripts/bench_replay.py                      # the test suite's tiny Qwen3-MoE, CPU
    python scripts/bench_replay.py --hidden 256 --experts 16 --layers 4 --device cuda

Builds a random tiny Qwen3-MoE (`trainer.tiny`, nothing downloaded), opens a LoRA session (or
full weights with `--full`) on the real engine, samples `--prompts` x `--group` sequences with
`return_routed_experts=True`, and builds the same GRPO batch twice: each sample with its
sequence's `routed_experts_key`, and without. The two arms then alternate, forward-backward
after forward-backward on the same weights (no optim-step), and the script prints the median
of `--steps` timed calls of each after `--warmup`, side by side, and their ratio; `--json`
writes them too. A with-keys call includes reading its key files (`attach_routed_experts`). Wall and
CPU-time medians are both printed: on a shared machine the process's CPU time (one torch thread
by default, `--threads`) is the steadier figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.checkpoint.store import CheckpointStore
from trainer.contract.specs import (
    EncodedTextChunk,
    LoraConfig,
    LossConfig,
    ModelEntry,
    ModelInput,
    ModelInputChunk,
    ResourceSpec,
    Sample,
    SamplingParams,
    SessionSpec,
    TensorData,
)
from trainer.engine.resource import ModelResource
from trainer.tiny import TinySpec, save_model

GRPO = LossConfig.model_validate({"type": "LOSS_TYPE_GRPO"})


def _input(tokens: list[int]) -> ModelInput:
    return ModelInput(chunks=[ModelInputChunk(encoded_text=EncodedTextChunk(tokens=tokens))])


def _tensor(data: list[Any], dtype: str = "float32") -> TensorData:
    return TensorData.model_validate({"data": data, "dtype": dtype})


def _sample(prompt: list[int], seq: dict[str, Any], advantage: float, keyed: bool) -> Sample:
    tokens = [int(t) for t in seq["tokens"]]
    full = prompt + tokens
    p = len(prompt) - 1
    mask = [0.0] * p + [1.0] * len(tokens)
    inputs = {
        "target_tokens": _tensor(full[1:], "int64"),
        "mask": _tensor(mask),
        "logprobs": _tensor([0.0] * p + list(seq["logprobs"])),
        "advantages": _tensor([0.0] * p + [advantage] * len(tokens)),
    }
    key = seq.get("routed_experts_key") if keyed else None
    return Sample(model_input=_input(full[:-1]), loss_fn_inputs=inputs, routed_experts_key=key)


def _batches(session: Any, args: argparse.Namespace) -> tuple[list[Sample], list[Sample]]:
    gen = torch.Generator().manual_seed(0)
    keyed: list[Sample] = []
    plain: list[Sample] = []
    for i in range(args.prompts):
        prompt = torch.randint(2, args.vocab, (args.prompt_len,), generator=gen).tolist()
        params = SamplingParams.model_validate(
            {"max_tokens": args.max_tokens, "temperature": 1.0, "seed": i}
        )
        out = session.sample(
            [_input(prompt)],
            num_samples=args.group,
            sampling_params=params,
            return_routed_experts=True,
        )
        for j, seq in enumerate(out["results"][0]["sequences"]):
            assert seq.get("routed_experts_key"), "the MoE sampler returned no key"
            advantage = float(j - (args.group - 1) / 2)
            keyed.append(_sample(prompt, seq, advantage, keyed=True))
            plain.append(_sample(prompt, seq, advantage, keyed=False))
    return keyed, plain


def _time(session: Any, samples: list[Sample], sync: Any) -> tuple[float, float]:
    """(wall, CPU time of this process) of one forward-backward."""
    sync()
    start, cpu = time.perf_counter(), time.process_time()
    session.forward_backward(GRPO, samples)
    sync()
    return time.perf_counter() - start, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--full", action="store_true", help="full weights instead of LoRA")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--moe-intermediate", type=int, default=48)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=4, help="sequences per prompt")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    spec = TinySpec(
        arch="qwen3_moe",
        vocab=args.vocab,
        hidden=args.hidden,
        layers=args.layers,
        experts=args.experts,
        experts_per_tok=args.top_k,
        moe_intermediate=args.moe_intermediate,
        scale=8.0,
        max_positions=max(512, args.prompt_len + args.max_tokens),
    )
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_model(spec, Path(tmp) / "model")
        entry = ModelEntry(name="tiny-moe", location=str(model_dir), max_lora_rank=args.rank)
        resource_spec = ResourceSpec(
            base_model="tiny-moe",
            lora_enabled=not args.full,
            compute_config={"num_generator_replicas": 1},
        )
        resource = ModelResource(
            entry, resource_spec, CheckpointStore(Path(tmp) / "storage"), device=args.device
        )
        lora = None if args.full else LoraConfig(rank=args.rank, alpha=2 * args.rank, seed=0)
        session = resource.create_session("bench", SessionSpec(lora_config=lora))
        keyed, plain = _batches(session, args)
        device = torch.device(args.device)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        times: dict[str, list[tuple[float, float]]] = {"with_keys": [], "without_keys": []}
        for step in range(args.warmup + args.steps):
            # alternate which arm goes first, so drift and caches favour neither
            order = [("with_keys", keyed), ("without_keys", plain)]
            for name, samples in order if step % 2 == 0 else order[::-1]:
                elapsed = _time(session, samples, sync)
                if step >= args.warmup:
                    times[name].append(elapsed)
        resource.close()

    def median(name: str, which: int) -> float:
        return statistics.median(t[which] for t in times[name])

    tokens = sum(len(s.model_input.chunks[0].encoded_text.tokens) for s in keyed)  # type: ignore[union-attr]
    with_keys, without = median("with_keys", 0), median("without_keys", 0)
    cpu_with, cpu_without = median("with_keys", 1), median("without_keys", 1)
    result = {
        "model": f"qwen3_moe hidden {args.hidden}, {args.layers} layers, {args.experts} experts "
        f"top-{args.top_k}",
        "kind": "full" if args.full else f"lora r{args.rank}",
        "device": args.device,
        "samples": len(keyed),
        "tokens": tokens,
        "steps": args.steps,
        "threads": torch.get_num_threads(),
        "median_s_with_keys": with_keys,
        "median_s_without_keys": without,
        "ratio": with_keys / without,
        "median_cpu_s_with_keys": cpu_with,
        "median_cpu_s_without_keys": cpu_without,
        "cpu_ratio": cpu_with / cpu_without,
    }
    print(
        f"{result['model']}, {result['kind']}, {args.device}: {len(keyed)} samples, "
        f"{tokens} tokens per forward-backward, median of {args.steps}"
    )
    print("                wall (median)   CPU time (median)")
    print(f"  without keys  {without * 1e3:9.2f} ms    {cpu_without * 1e3:9.2f} ms")
    print(
        f"  with keys     {with_keys * 1e3:9.2f} ms    {cpu_with * 1e3:9.2f} ms"
        f"   (wall {result['ratio']:.3f}x, CPU {result['cpu_ratio']:.3f}x)"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
