"""Tiny random models built from a config: the one builder behind the demo, the benchmarks and
the tests.

A `TinySpec` names a Qwen3-, Llama- or Qwen3-MoE-shaped decoder (`arch="qwen3_moe"`: every
layer a sparse MoE block of `experts` experts, `experts_per_tok` routed per token, with fused
3-D expert weights); `build_model` random-inits it under a seed (no download), and
`save_model` writes it the way `trainer.compute.model` loads any HF model (safetensors +
config.json).
The same spec and seed always give the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal


@dataclass(frozen=True)
class TinySpec:
    arch: Literal["qwen3", "llama", "qwen3_moe"] = "qwen3"
    vocab: int = 128
    hidden: int = 64
    intermediate: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int | None = None  # None: hidden // heads
    tied: bool = True
    max_positions: int = 512
    bos: int | None = 0
    eos: int | None = 1
    pad: int | None = 0  # also the embedding's padding row, zeroed at init
    scale: float = 1.0  # every 2-D and 3-D weight is multiplied by it after init (1: as is)
    # qwen3_moe only: every layer sparse; `scale` applies to the router and the experts too
    experts: int = 4
    experts_per_tok: int = 2
    moe_intermediate: int = 48
    norm_topk_prob: bool = True


def hf_config(spec: TinySpec, **extra: Any) -> Any:
    """The transformers config of `spec`; `extra` adds or overrides config fields."""
    from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

    fields: dict[str, Any] = dict(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim or spec.hidden // spec.heads,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=spec.tied,
        bos_token_id=spec.bos,
        eos_token_id=spec.eos,
        pad_token_id=spec.pad,
    )
    fields.update(extra)
    if spec.arch == "qwen3":
        return Qwen3Config(**fields)
    if spec.arch == "llama":
        return LlamaConfig(**fields)
    if spec.arch == "qwen3_moe":
        moe = dict(
            num_experts=spec.experts,
            num_experts_per_tok=spec.experts_per_tok,
            moe_intermediate_size=spec.moe_intermediate,
            norm_topk_prob=spec.norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
        moe.update(extra)
        return Qwen3MoeConfig(**{**fields, **moe})
    raise ValueError(f"arch: unknown tiny architecture {spec.arch!r}")


def build_model(spec: TinySpec, seed: int = 0, dtype: Any = None, **extra: Any) -> Any:
    """A random-init model of `spec` (weights drawn under `torch.manual_seed(seed)`)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = hf_config(spec, **extra)
    torch.manual_seed(seed)
    kwargs = {} if dtype is None else {"dtype": dtype}
    model = AutoModelForCausalLM.from_config(config, **kwargs)
    if spec.scale != 1.0:
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() in (2, 3):  # 3-D: fused experts (qwen3_moe)
                    param.mul_(spec.scale)
    return model


def save_model(spec: TinySpec, out_dir: Path, seed: int = 0, dtype: Any = None) -> Path:
    """`build_model(spec, seed)` saved to `out_dir` (created if missing); returns `out_dir`."""
    model = build_model(spec, seed, dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    return out_dir
