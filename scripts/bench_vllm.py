"""The vLLM generator backend beside the in-process decode loop, in one run (CPU).

    python scripts/bench_vllm.py --python ~/.cache/trainer-tests/vllm-venv-*/bin/python
    python scripts/bench_vllm.py --python PY --batches 1,8 --tokens 16 --runs 1   # quick

On a GPU, `scripts/bench_gpu.py --vllm-python PY` runs it on a Qwen3-0.6B shape in bf16 at
batch 64 x 512 tokens (`--device cuda --dtype bfloat16`).

A Qwen3-shaped model of about 150 M parameters (`--hidden 1024 --layers 12`, tied, random,
float32) saved once; two resources on it per kind, one per backend. Rows of the figures:

- rollout tokens/s, full weights and LoRA (rank 32), at each batch of `--batches` (rows of
  `--tokens` new tokens after a 16-token prompt, temperature 1, seeded): vLLM ÷ in-process, on
  the same weights (one optim-step and a sync first, so they are not the base model's);
- LoRA weights-sync on vLLM (write the adapter, load it into the replica, drop the old one) ÷
  writing the adapter files alone;
- full-weight sync on vLLM (the published copy, its safetensors file, the reload in place);
- one GRPO step (8 prompts x 4 samples, forward-backward, optim-step, sync), vLLM ÷ in-process.

Medians of `--runs` runs after a warm-up; prints a JSON object, one key per row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from safetensors.torch import load_file, save_file

from trainer.checkpoint.store import CheckpointStore
from trainer.contract.generation import GeneratorOptions
from trainer.contract.specs import (
    AdamParams,
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
from trainer.engine.session import TrainingSession
from trainer.tiny import TinySpec, save_model

CE = LossConfig(type="cross_entropy")
PPO = LossConfig(type="ppo")
SYNC = "WEIGHT_SYNC_TYPE_SYNCHRONOUS"
PROMPT_LEN = 16


def model_input(tokens: list[int]) -> ModelInput:
    return ModelInput(chunks=[ModelInputChunk(encoded_text=EncodedTextChunk(tokens=tokens))])


def tensor(values: list[Any], dtype: str = "float32") -> TensorData:
    return TensorData(data=values, dtype=dtype)


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (PROMPT_LEN,), generator=gen).tolist() for _ in range(n)]


def ce_batch(vocab: int, n: int = 4, length: int = 32) -> list[Sample]:
    out = []
    for seq in prompts(n, vocab, seed=1):
        seq = (seq * 3)[: length + 1]
        inputs = {"target_tokens": tensor(seq[1:], "int64"), "weights": tensor([1.0] * length)}
        out.append(Sample(model_input=model_input(seq[:-1]), loss_fn_inputs=inputs))
    return out


ENV: dict[str, str] = {}  # the replicas' environment (`--env KEY=VALUE`)
SETUP: dict[str, Any] = {"device": "cpu", "dtype": "float32", "context": 512}


def resource(model: Path, storage: Path, lora: bool, python: str | None) -> ModelResource:
    dtype = SETUP["dtype"]
    generator = (
        GeneratorOptions(backend="vllm", python=python, dtype=dtype, kv_cache_gib=2, env=ENV)
        if python
        else None
    )
    entry = ModelEntry(
        name="bench",
        location=str(model),
        max_seq_length=SETUP["context"],
        max_lora_rank=32,
        dtype=dtype,
        generator=generator,
    )
    spec = ResourceSpec(base_model="bench", lora_enabled=lora)
    return ModelResource(entry, spec, CheckpointStore(storage), device=SETUP["device"])


def session(res: ModelResource, lora: bool, vocab: int) -> TrainingSession:
    spec = SessionSpec(lora_config=LoraConfig(rank=32, alpha=64, seed=0)) if lora else SessionSpec()
    s = res.create_session("s", spec)
    s.forward_backward(CE, ce_batch(vocab))
    s.optim_step(AdamParams(learning_rate=1e-3))
    s.weights_sync(SYNC)
    return s


def median_time(fn: Callable[[], Any], runs: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def rollout(s: TrainingSession, rows: int, tokens: int, vocab: int) -> Callable[[], Any]:
    inputs = [model_input(p) for p in prompts(rows, vocab)]
    params = SamplingParams(max_tokens=tokens, temperature=1.0, seed=7)
    return lambda: s.sample(inputs, num_samples=1, sampling_params=params)


def grpo_step(s: TrainingSession, tokens: int, vocab: int) -> Callable[[], Any]:
    inputs = [model_input(p) for p in prompts(8, vocab, seed=3)]

    def step() -> None:
        out = s.sample(
            inputs, num_samples=4, sampling_params=SamplingParams(max_tokens=tokens, seed=5)
        )
        batch = []
        for prompt, result in zip(inputs, out["results"], strict=True):
            p = prompt.chunks[0].encoded_text.tokens  # type: ignore[union-attr]
            for seq in result["sequences"]:
                full = p + seq["tokens"]
                pad = [0.0] * (len(p) - 1)
                n = len(seq["tokens"])
                batch.append(
                    Sample(
                        model_input=model_input(full[:-1]),
                        loss_fn_inputs={
                            "target_tokens": tensor(full[1:], "int64"),
                            "logprobs": tensor(pad + seq["logprobs"]),
                            "advantages": tensor(pad + [float(sum(seq["tokens"]) % 3 - 1)] * n),
                            "mask": tensor(pad + [1.0] * n),
                        },
                    )
                )
        s.forward_backward(PPO, batch)
        s.optim_step(AdamParams(learning_rate=1e-4))
        s.weights_sync(SYNC)

    return step


def write_adapter_alone(s: TrainingSession, where: Path) -> Callable[[], None]:
    """What a LoRA sync on vLLM writes, without loading it anywhere."""
    from trainer.compute.policy import LoraPolicy

    policy = s.policy
    assert isinstance(policy, LoraPolicy)

    def write() -> None:
        tensors = {n: t.detach().contiguous() for n, t in policy.published_tensors().items()}
        save_file(tensors, str(where / "adapter_model.safetensors"), metadata={"format": "pt"})
        (where / "adapter_config.json").write_text(json.dumps(policy.peft_config_dict()))

    return write


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", required=True, help="interpreter with vllm installed")
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--intermediate", type=int, help="default: 2.75 x hidden")
    parser.add_argument("--heads", type=int, help="default: hidden / 64")
    parser.add_argument("--kv-heads", type=int, help="default: hidden / 256")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--kinds", default="full,lora")
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for the replicas")
    args = parser.parse_args()
    ENV.update(item.split("=", 1) for item in args.env)
    SETUP.update(device=args.device, dtype=args.dtype, context=max(512, 2 * args.tokens + 64))
    batches = [int(b) for b in args.batches.split(",")]
    root = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    spec = TinySpec(
        vocab=args.vocab,
        hidden=args.hidden,
        intermediate=args.intermediate or int(args.hidden * 2.75),
        layers=args.layers,
        heads=args.heads or args.hidden // 64,
        kv_heads=args.kv_heads or max(1, args.hidden // 256),
        head_dim=args.head_dim,
        max_positions=max(1024, 2 * args.tokens + 64),
        eos=None,
    )
    model = save_model(spec, root / "model")
    params = sum(t.numel() for t in load_file(str(model / "model.safetensors")).values())
    out: dict[str, Any] = {"parameters": params, "tokens_per_row": args.tokens, "rows": {}}
    for lora in [kind == "lora" for kind in args.kinds.split(",")]:
        kind = "lora" if lora else "full"
        hf = resource(model, root / f"hf-{kind}", lora, None)
        vl = resource(model, root / f"vllm-{kind}", lora, args.python)
        s_hf, s_vl = session(hf, lora, args.vocab), session(vl, lora, args.vocab)
        for rows in batches:
            t_hf = median_time(rollout(s_hf, rows, args.tokens, args.vocab), args.runs)
            t_vl = median_time(rollout(s_vl, rows, args.tokens, args.vocab), args.runs)
            new = rows * args.tokens
            out["rows"][f"{kind} batch {rows}"] = {
                "in_process_tok_s": round(new / t_hf, 1),
                "vllm_tok_s": round(new / t_vl, 1),
                "ratio": round(t_hf / t_vl, 2),
            }
            print(json.dumps({f"{kind} batch {rows}": out["rows"][f"{kind} batch {rows}"]}))
        sync = median_time(lambda s=s_vl: s.weights_sync(SYNC), args.runs)
        if lora:
            scratch = root / "adapter-alone"
            scratch.mkdir()
            write = median_time(write_adapter_alone(s_vl, scratch), args.runs)
            out["lora_sync"] = {
                "sync_s": round(sync, 4),
                "write_adapter_s": round(write, 4),
                "ratio": round(sync / write, 2),
            }
        else:
            out["full_sync_s"] = round(sync, 3)
        t_hf = median_time(grpo_step(s_hf, args.tokens, args.vocab), args.runs)
        t_vl = median_time(grpo_step(s_vl, args.tokens, args.vocab), args.runs)
        out[f"grpo_step_{kind}"] = {
            "in_process_s": round(t_hf, 2),
            "vllm_s": round(t_vl, 2),
            "ratio": round(t_hf / t_vl, 2),
        }
        print(json.dumps({k: v for k, v in out.items() if k != "rows"}))
        hf.close()
        vl.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
