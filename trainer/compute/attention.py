"""Attention for packed rows: which implementations take samples laid end to end, and
`packed_sdpa`, an exact varlen attention from plain SDPA for machines without FlashAttention."""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch

PACKED_SDPA = "packed_sdpa"
BOOLEAN_MASK_ATTENTION = ("sdpa", PACKED_SDPA)  # take a boolean mask; others an additive one


def is_varlen(attn_implementation: str | None) -> bool:
    """Whether this attention takes packed samples as one unpadded row split by position ids."""
    return attn_implementation is not None and (
        "flash" in attn_implementation or attn_implementation == PACKED_SDPA
    )


_memo = threading.local()  # the last position ids' segments on this thread (`_row_segments`)


def _row_segments(position_ids: torch.Tensor, row: int) -> list[tuple[int, int]]:
    """Row `row`'s samples as (start, end), split where its positions restart at 0.

    Every layer of a forward (and the recompute of activation checkpointing) is given the same
    position ids, so they are read to the host once and reused while the tensor lives
    unchanged: one device-to-host copy per forward, not one per layer."""
    entry = getattr(_memo, "entry", None)
    if entry is None or entry[0]() is not position_ids or entry[1] != position_ids._version:
        entry = (weakref.ref(position_ids), position_ids._version, _all_segments(position_ids))
        _memo.entry = entry
    rows: list[list[tuple[int, int]]] = entry[2]
    return rows[min(row, len(rows) - 1)]


def _all_segments(position_ids_R_T: torch.Tensor) -> list[list[tuple[int, int]]]:
    length = int(position_ids_R_T.shape[-1])
    starts: list[list[int]] = [[] for _ in range(position_ids_R_T.shape[0])]
    for row, column in torch.nonzero(position_ids_R_T == 0).tolist():  # the one host copy
        starts[row].append(column)
    out = []
    for row_starts in starts:
        if not row_starts or row_starts[0] != 0:
            row_starts = [0, *row_starts]
        out.append(list(zip(row_starts, [*row_starts[1:], length], strict=True)))
    return out


def packed_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Exact varlen attention from plain SDPA: one causal `scaled_dot_product_attention` per
    packed sample (split where `position_ids` restart), so work is Σ Tᵢ², not (Σ Tᵢ)², and no
    mask is materialised. On CPU this is the exact fallback of FlashAttention's varlen path;
    on CUDA SDPA picks its flash kernel for each causal, unmasked segment.

    query `[B, Hq, T, D]`, key/value `[B, Hkv, T, D]` → output `[B, T, Hq, D]` (transformers'
    attention-interface layout). A layer's `sliding_window` limits each sample's keys to its
    last `sliding_window` positions (a banded mask per sample); attention sinks and soft-capping
    are refused (those models compute with eager attention). Without position ids a row is one
    sample. With a mask or a KV cache (keys longer than queries) it is plain SDPA with
    transformers' own masks (windows included), so generation is unchanged.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    for name in ("s_aux", "softcap"):  # sinks, soft-capping: `architecture.needs_eager`
        if kwargs.get(name) is not None:
            raise ValueError(f"packed_sdpa cannot compute attention with {name}; use eager")
    position_ids = kwargs.get("position_ids")
    if attention_mask is not None or query.shape[2] != key.shape[2]:  # a mask, or a KV cache
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    groups = int(getattr(module, "num_key_value_groups", 1))
    dropout_p = dropout if module.training else 0.0
    window = kwargs.get("sliding_window")
    rows = []
    for b in range(query.shape[0]):
        parts = []
        if isinstance(position_ids, torch.Tensor):
            segments = _row_segments(position_ids, b)
        else:
            segments = [(0, int(query.shape[2]))]
        for start, end in segments:
            band = _band(end - start, window, query.device)
            out = torch.nn.functional.scaled_dot_product_attention(
                query[b : b + 1, :, start:end],
                key[b : b + 1, :, start:end],
                value[b : b + 1, :, start:end],
                attn_mask=band,
                dropout_p=dropout_p,
                scale=scaling,
                is_causal=band is None,
                enable_gqa=groups > 1,
            )
            parts.append(out)
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows, dim=0).transpose(1, 2).contiguous(), None


def _band(n: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """A sliding window's mask over one sample of `n` tokens (True = attend): position i
    attends to j when `i - window < j <= i`, as transformers' `sliding_window_overlay`. None
    when the window covers the whole sample (plain causal attention)."""
    if window is None or n <= window:
        return None
    i = torch.arange(n, device=device)
    distance = i[:, None] - i[None, :]
    return (distance >= 0) & (distance < window)


_known = threading.local()


@contextlib.contextmanager
def padded_masks(padded: bool = True) -> Iterator[None]:
    """While active on this thread (with `padded`), the padding masks the model is given are
    known to pad some row (the decode loop's left-padded rows, `trainer/compute/sampler.py`):
    SDPA's mask is built without first asking the device whether it pads nothing
    (`padding_mask.all()` in transformers, a host sync per forward). The mask is the same."""
    before = getattr(_known, "padded", False)
    _known.padded = padded
    try:
        yield
    finally:
        _known.padded = before


def _packed_mask(**kwargs: Any) -> torch.Tensor | None:
    """No mask for packed rows (the kernel splits them and applies windows); SDPA's own mask
    (the layer's causal, sliding or chunked one) whenever there is a padding mask to honour
    (batched generation) or a KV cache (queries after the first position)."""
    fresh = int(kwargs.get("q_offset") or 0) == 0 and kwargs.get("kv_length") == kwargs.get(
        "q_length"
    )
    if kwargs.get("attention_mask") is None and fresh:
        return None
    if kwargs.get("attention_mask") is not None and getattr(_known, "padded", False):
        kwargs["allow_is_causal_skip"] = False  # it pads a row: never skippable (`padded_masks`)
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(**kwargs)


def use_packed_sdpa(model: torch.nn.Module) -> None:
    """Switch a transformers model to `packed_sdpa` (registered once, process-wide)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(PACKED_SDPA, packed_sdpa_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_SDPA, _packed_mask)
    set_impl = getattr(model, "set_attn_implementation", None)
    if callable(set_impl):
        set_impl(PACKED_SDPA)
    else:
        model.config._attn_implementation = PACKED_SDPA  # type: ignore[union-attr]
