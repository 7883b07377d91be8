"""What serves a resource's samples: the `[generator]` table of the TOML config, the
`--generator-*` flags, and a catalogue entry's own `generator` table over them.

`backend = "hf"` is the worker's own decode loop (`trainer/compute/sampler.py`); `"vllm"` runs
`compute_config.num_generator_replicas` vLLM engines as child processes of the worker, each
in the interpreter `python` names (vLLM lives in its own environment: its pins clash with
the worker's). Design notes: `docs/design/vllm.md`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from trainer.contract.base import StrictSpec

Backend = Literal["hf", "vllm"]


class GeneratorOptions(StrictSpec):
    """How samples are generated (the `[generator]` table; a model's `generator` table)."""

    backend: Backend = Field(
        default="hf", description="`hf`: the worker's own decode loop; `vllm`: vLLM replicas"
    )
    python: str = Field(
        default="", description="interpreter with vllm installed (empty: the worker's own)"
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto",
        description="the replicas' weights dtype (auto: the trainer's: the model entry's "
        "dtype, else float32 on the CPU and bfloat16 on CUDA)",
    )
    max_model_len: int = Field(
        default=0, ge=0, description="context length of a replica (0: the model's max_seq_length)"
    )
    gpu_memory_utilization: float = Field(
        default=0.85, gt=0.0, le=1.0, description="share of a GPU's memory a replica takes"
    )
    kv_cache_gib: int = Field(
        default=1,
        ge=1,
        description="GiB of KV cache of a replica on the CPU (VLLM_CPU_KVCACHE_SPACE)",
    )
    max_loras: int = Field(
        default=8,
        ge=2,
        description="adapters one replica batch holds; one slot always stays free (see docs)",
    )
    max_lora_rank: int = Field(
        default=0, ge=0, description="largest adapter rank (0: the model's max_lora_rank)"
    )
    enforce_eager: bool = Field(default=True, description="no CUDA graphs / torch.compile")
    threads: int = Field(default=0, ge=0, description="CPU threads of a replica (0: vLLM's)")
    start_timeout_s: float = Field(
        default=300.0, gt=0, description="how long a replica may take to become healthy"
    )
    extra_engine_args: dict[str, Any] = Field(
        default_factory=dict, description="more vllm.EngineArgs keys, passed as they are"
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="environment of the replicas, over the worker's (VLLM_*, OMP_*, ...)",
    )

    def over(self, entry: GeneratorOptions | None) -> GeneratorOptions:
        """These options with the keys a catalogue entry sets itself laid over them."""
        if entry is None:
            return self
        return GeneratorOptions.model_validate(
            {**self.model_dump(), **entry.model_dump(exclude_unset=True)}
        )
