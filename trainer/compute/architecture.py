"""What a model's layers are, and the trainer layout that keeps its logprobs exact.

Read once per loaded model from its config and modules (`describe`): the type of every decoder
layer (full, sliding or chunked attention; linear attention, SSM or convolution layers that
carry state from one position to the next), the sliding windows, attention sinks, attention
soft-capping, and what the model does between its last hidden state and its logits (`Head`).
From these follows the layout a micro-batch is laid out in (docs/semantics.md §20):

- `PACKED`: samples laid end to end in shared rows. A varlen attention (FlashAttention,
  `packed_sdpa`) splits them where the position ids restart and applies each layer's window;
  any other attention gets the block-diagonal causal mask. Only for models whose every layer
  is full or sliding attention (the latter with a varlen attention) or position-wise.
- `ROWS`: one sample per row, right-padded, with a 2-D padding mask from which the model
  builds its own masks (full, sliding, chunked) for each layer type. A causal layer never sees
  the padding after a sample, so this is exact for any causal model: the layout of every
  hybrid (linear attention, SSM, convolution), of sinks and soft-capped attention, and the
  fallback when the packed layout fails its check.

`trainer.compute.selfcheck` then proves the choice against the model's own forward of each
sequence alone, and moves to the next candidate (or refuses the model) when it disagrees.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from trainer.compute.attention import is_varlen

PACKED = "packed"
ROWS = "rows"

ATTRIBUTE = "trainer_architecture"  # where the chosen `Architecture` is kept on the model

# Layer types (transformers' `layer_types`) that attend over the sample's own positions only
# through the attention mask: a packed layout keeps them apart with masks or a varlen kernel.
_ATTENTION = {"full_attention", "sliding_attention"}
# Position-wise layers (no attention at all, or an MLP/MoE-only layer).
_POSITIONWISE = {"moe", "mlp", "dense", "sparse", "dummy"}
# Layer types that carry state along the sequence (a conv window, a recurrent state): exact
# only with one sample per row.
_STATEFUL = {"linear_attention", "conv", "hybrid", "hybrid_sliding", "mamba", "recurrent"}
# Layer types whose cache is bounded by a window (`sliding_window` / `attention_chunk_size`).
_WINDOWED = {
    "sliding_attention",
    "chunked_attention",
    "hybrid_sliding",
    "reference_sliding_attention",
}
# Decoder sub-modules whose class names mark a stateful layer, for configs without
# `layer_types` that say so (Mamba, Gated DeltaNet, short convolutions, RG-LRU, ...).
_STATEFUL_CLASS = re.compile(r"Mamba|DeltaNet|LinearAttention|ShortConv|Rglru|RGLRU|SSM|Recurrent")


_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


@dataclass(frozen=True)
class Head:
    """What the model does to `lm_head(hidden)` to get its logits: `softcap · tanh(z / softcap)`
    (Gemma's final soft-capping) and then `· scale` (Cohere's `logit_scale`, Granite's
    `1 / logits_scaling`). Identity by default."""

    softcap: float | None = None
    scale: float = 1.0

    @property
    def identity(self) -> bool:
        return self.softcap is None and self.scale == 1.0

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        if self.scale != 1.0:
            logits = logits * self.scale
        return logits

    def describe(self) -> str:
        parts = []
        if self.softcap is not None:
            parts.append(f"final soft-capping {self.softcap:g}")
        if self.scale != 1.0:
            parts.append(f"logit scale {self.scale:g}")
        return ", ".join(parts) or "plain"


class OutputHead(nn.Module):
    """The model's output head followed by its logit transform (`Head`). The chunked logprob
    code treats it as any non-linear head: each chunk's logits are recomputed in its backward
    (`trainer.compute.logprobs`), so memory stays flat."""

    def __init__(self, head: nn.Module, transform: Head) -> None:
        super().__init__()
        self.head = head
        self.transform = transform

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.transform.apply(self.head(hidden))


@dataclass(frozen=True)
class Architecture:
    """A loaded model's layers, as far as exactness depends on them, and its layout."""

    model_type: str
    layer_types: tuple[str, ...]
    windows: tuple[int, ...]  # the distinct sliding-window (and chunk) sizes, ascending
    sinks: bool
    attn_softcap: float | None
    stateful: tuple[str, ...]  # what carries state along positions (layer types, classes)
    head: Head
    attn_implementation: str
    candidates: tuple[str, ...]  # exact layouts, fastest first
    experts: int | None = None  # routed experts per MoE layer (position-wise: no effect)
    latent_attention: bool = False  # MLA (compressed KV; attention as any other)
    layout: str = ""  # the chosen one (after the self-check: `selfcheck.prove`)
    checked: dict[str, float] = field(default_factory=dict, compare=False)  # layout -> max diff
    check_seconds: float = 0.0

    def __post_init__(self) -> None:
        if not self.layout:
            object.__setattr__(self, "layout", self.candidates[0])

    def features(self) -> list[str]:
        """The features that decide its layout, in words (README table, errors, logs)."""
        out = []
        kinds = sorted(set(self.layer_types))
        if kinds != ["full_attention"]:
            out.append("layers: " + "+".join(kinds))
        if self.windows:
            out.append("windows " + ",".join(str(w) for w in self.windows))
        if self.sinks:
            out.append("attention sinks")
        if self.attn_softcap is not None:
            out.append(f"attention soft-capping {self.attn_softcap:g}")
        if self.stateful:
            out.append("state along positions: " + ", ".join(self.stateful))
        if not self.head.identity:
            out.append(self.head.describe())
        if self.latent_attention:
            out.append("MLA")
        if self.experts:
            out.append(f"{self.experts} experts")
        return out

    def path(self) -> str:
        """The trainer path in words: layout and attention."""
        if self.layout == ROWS:
            return f"one sample per row ({self.attn_implementation})"
        if is_varlen(self.attn_implementation):
            return f"packed varlen ({self.attn_implementation})"
        return f"packed, block mask ({self.attn_implementation})"

    def chosen(self, layout: str, checked: dict[str, float], seconds: float) -> Architecture:
        return replace(self, layout=layout, checked=dict(checked), check_seconds=seconds)


def text_config(model: Any) -> Any:
    """The decoder's config (a composite model's text config, else the model's own)."""
    config = model.config
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if callable(getter) else config


def layer_types(config: Any) -> tuple[list[str], list[int | None]]:
    """Every decoder layer's type and its window (None: unbounded), as transformers reads them
    for its caches (`layer_types`, else inferred from `sliding_window` / `attention_chunk_size`)."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    types, kwargs = get_layer_types_and_kwargs(config)
    if isinstance(kwargs, dict):
        # older transformers (5.17, the GPU image's) return one kwargs dict for every layer,
        # whose `sliding_window` belongs to the sliding and chunked layers only
        kwargs = [kwargs if t in _WINDOWED else {} for t in types]
    return list(types), [k.get("sliding_window") for k in kwargs]


def head_transform(model: Any) -> Head:
    """The logit transform its config declares (`Head`); `selfcheck.check_head` then proves it
    against the model's own forward, so an undeclared transform is caught there."""
    config = model.config
    texts = [config, text_config(model)]
    softcap = next((v for c in texts if (v := getattr(c, "final_logit_softcapping", None))), None)
    scale = 1.0
    logit_scale = getattr(model, "logit_scale", None)  # Cohere keeps it on the model
    if isinstance(logit_scale, (int, float)) and not isinstance(logit_scale, bool):
        scale *= float(logit_scale)
    scaling = next((v for c in texts if (v := getattr(c, "logits_scaling", None))), None)
    if scaling:
        scale /= float(scaling)
    return Head(softcap=float(softcap) if softcap else None, scale=scale)


def _stateful_modules(model: Any) -> list[str]:
    decoder = model.get_decoder()
    found = set()
    for module in decoder.modules():
        name = type(module).__name__
        if isinstance(module, nn.Conv1d) or _STATEFUL_CLASS.search(name):
            found.add(name)
    return sorted(found)


def describe(model: Any) -> Architecture:
    """Read what the model's layers are (module docstring) and list its exact layouts."""
    config = text_config(model)
    attn = str(getattr(model.config, "_attn_implementation", None) or "eager")
    types, windows = layer_types(config)
    sinks = any(name.rsplit(".", 1)[-1] == "sinks" for name, _ in model.named_parameters())
    softcap = getattr(config, "attn_logit_softcapping", None)
    stateful = sorted({t for t in types if t in _STATEFUL} | set(_stateful_modules(model)))
    unknown = {t for t in types if t not in _ATTENTION | _POSITIONWISE | _STATEFUL}
    sliding = any(t == "sliding_attention" for t in types)
    packable = (
        not stateful
        and not unknown
        and not sinks
        and softcap is None
        and (not sliding or is_varlen(attn))
    )
    return Architecture(
        model_type=str(getattr(config, "model_type", None) or model.config.model_type),
        layer_types=tuple(types),
        windows=tuple(sorted({int(w) for w in windows if w})),
        sinks=sinks,
        attn_softcap=float(softcap) if softcap else None,
        stateful=tuple(stateful) + tuple(sorted(unknown)),
        head=head_transform(model),
        attn_implementation=attn,
        candidates=(PACKED, ROWS) if packable else (ROWS,),
        experts=describe_experts(config) if _holds_experts(model) else None,
        latent_attention=bool(getattr(config, "kv_lora_rank", None)),
    )


def describe_experts(config: Any) -> int | None:
    """The number of routed experts a (text) config declares; None: a dense model."""
    for key in _EXPERT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            return value
    return None


def _holds_experts(model: Any) -> bool:
    """Whether any layer holds routed experts (transformers' `*Experts` modules): a hybrid
    config may declare experts that its layer pattern never builds."""
    names = {type(module).__name__ for module in model.modules()}
    return any(name.endswith("Experts") and "Shared" not in name for name in names)


def needs_eager(model: Any) -> str | None:
    """Why SDPA or FlashAttention-2 would drop part of this model's attention (attention sinks,
    attention soft-capping), or None. Such a model computes with eager attention."""
    if any(name.rsplit(".", 1)[-1] == "sinks" for name, _ in model.named_parameters()):
        return "attention sinks"
    if getattr(text_config(model), "attn_logit_softcapping", None):
        return "attention soft-capping"
    return None


def of(model: Any) -> Architecture:
    """The model's architecture: the one chosen at load, else read now (and kept)."""
    found = getattr(model, ATTRIBUTE, None)
    if isinstance(found, Architecture):
        return found
    arch = describe(model)
    keep(model, arch)
    return arch


def keep(model: Any, arch: Architecture) -> None:
    object.__setattr__(model, ATTRIBUTE, arch)


def layout_of(model: Any) -> str:
    return of(model).layout


def output_head(model: Any) -> nn.Module:
    """The module that turns the last hidden state into the model's logits: its output head,
    wrapped with its logit transform when it has one."""
    head = model.get_output_embeddings()
    transform = of(model).head
    return head if transform.identity else OutputHead(head, transform)
