"""What each vLLM generator replica of a catalogue entry starts with: the settings
`vllm_child/vllm_replica.py` reads (`trainer/engine/replicas.py` starts the replicas)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainer.compute.model import local_dir, resolve_dtype

if TYPE_CHECKING:
    import torch

    from trainer.contract.generation import GeneratorOptions
    from trainer.contract.specs import ModelEntry

# the adapter ranks vLLM accepts as `max_lora_rank`
_VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def replica_config(
    entry: ModelEntry,
    options: GeneratorOptions,
    *,
    lora: bool,
    tokenizer: bool,
    device: torch.device,
) -> dict[str, Any]:
    """What each replica of `entry` starts with (`vllm_child/vllm_replica.py` reads it). Its
    `max_lora_rank` is the generator's, else the model's, rounded up to a rank vLLM takes.
    Its dtype is the generator's, else the trainer's own (`resolve_dtype`: the entry's, else
    float32 on the CPU and bfloat16 on CUDA), so its logprobs are the trainer's precision."""
    model = local_dir(entry.location, entry.revision)
    rank = options.max_lora_rank or entry.max_lora_rank
    dtype: str = options.dtype
    if dtype == "auto":
        dtype = str(resolve_dtype(entry.dtype, device)).removeprefix("torch.")
    return {
        "model": str(model),
        "tokenizer": str(entry.tokenizer or model) if tokenizer else None,
        "dtype": dtype,
        "max_model_len": options.max_model_len or entry.max_seq_length,
        "enforce_eager": options.enforce_eager,
        "enable_lora": lora,
        "max_loras": options.max_loras,
        "max_lora_rank": next((r for r in _VLLM_RANKS if r >= rank), rank),
        "kv_cache_gib": options.kv_cache_gib,
        "threads": options.threads,
        "device": device.type,
        "gpu_memory_utilization": options.gpu_memory_utilization,
        "trust_remote_code": entry.trust_remote_code,
        "extra_engine_args": options.extra_engine_args,
        "env": options.env,
    }
