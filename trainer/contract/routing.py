"""Routing matrices on the wire (docs/semantics.md §12): one position's MoE expert ids as a
base64 string, the Fireworks SDK's `base64_inline` R3 format.

A matrix is the expert ids `[layers, k]` (MoE layers in order, the router's top-k in its
order), flattened row-major, as unsigned 8-bit integers (16-bit little-endian for a model
with more than 256 experts), base64-encoded. The empty string is "no matrix": the router
keeps its own choice at that position.
"""

from __future__ import annotations

import base64
import binascii

import numpy as np

FORMAT = "base64_inline"
"""The one format this worker reads and writes (`routing_matrix_format`)."""

UINT8_EXPERTS = 256
"""Up to this many experts a matrix is uint8; past it, uint16 little-endian."""


def encode(routes_P_L_K: np.ndarray, experts: int) -> list[str]:
    """One base64 matrix per position of `routes_P_L_K` (expert ids `[positions, layers, k]`)."""
    dtype = np.uint8 if experts <= UINT8_EXPERTS else np.dtype("<u2")
    flat = np.ascontiguousarray(routes_P_L_K, dtype=dtype).reshape(len(routes_P_L_K), -1)
    return [base64.b64encode(row.tobytes()).decode("ascii") for row in flat]


def decode(matrix: str, layers: int, k: int, experts: int) -> np.ndarray | None:
    """A matrix's expert ids `[layers, k]` (int64); None for the empty string. ValueError
    (its text says why) when it is not base64, not `layers·k` ids, an id is out of range, or
    a layer names an expert twice."""
    if matrix == "":
        return None
    try:
        raw = base64.b64decode(matrix, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("not base64") from None
    count = layers * k
    if len(raw) == count:
        ids = np.frombuffer(raw, dtype=np.uint8)
    elif len(raw) == 2 * count and experts > UINT8_EXPERTS:
        ids = np.frombuffer(raw, dtype=np.dtype("<u2"))
    else:
        width = "1" if experts <= UINT8_EXPERTS else "2"
        raise ValueError(
            f"{len(raw)} bytes; this model's matrix is {layers} MoE layers x top-{k} experts "
            f"({count} ids of {width} byte{'s' if width == '2' else ''} each)"
        )
    ids = ids.astype(np.int64)
    if ids.size and int(ids.max()) >= experts:
        raise ValueError(f"expert id {int(ids.max())} is out of range (this model has {experts})")
    ids_L_K = ids.reshape(layers, k)
    for layer, row in enumerate(ids_L_K):
        if len(set(row.tolist())) != k:
            raise ValueError(f"MoE layer {layer} names an expert twice ({row.tolist()})")
    return ids_L_K
