"""Rules on single values: floats finite (also once narrowed to float32), token ids in range,
and the field that names a bad id by its chunk and its place in it (`token_field`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from trainer.contract.arrays import INT64_MAX, IntArray, NumArray, first
from trainer.contract.errors import InputError
from trainer.contract.rules.limits import Tokens


def check_finite(values: Sequence[float] | NumArray, field: str) -> None:
    """`{field}[k]: is not finite` for the first NaN or infinity, in the values sent or once
    they are float32 (as every float input and gradient is computed with): 1e39 is refused too.
    Integer arrays always pass."""
    array = np.asarray(values)
    if array.dtype.kind not in "iu":
        array = array.astype(np.float64, copy=False)
        if (k := first(~np.isfinite(array))) is not None:
            raise InputError(f"{field}[{k}]", "is not finite")
        with np.errstate(over="ignore"):
            narrowed = array.astype(np.float32)
        if (k := first(~np.isfinite(narrowed))) is not None:
            raise InputError(
                f"{field}[{k}]", f"{float(array[k])!r} is not finite in float32 (|x| over 3.4e38)"
            )


def token_values(model_input: Tokens) -> IntArray | list[int]:
    """The ids of a model input: one int64 array, or the list when an id is past int64 (which
    `check_ids` then refuses by its position)."""
    try:
        return model_input.token_array()
    except OverflowError:
        return model_input.tokens


def check_ids(
    values: Sequence[int] | NumArray,
    field: str | Callable[[int], str],
    vocab_size: int | None = None,
) -> IntArray:
    """Token ids as a fresh int64 array (never aliasing the request). `{field}[k]` names the
    first that is negative or, with a vocabulary, not below `vocab_size` (`field(k)` where
    `field` maps a position to its name)."""
    try:
        ids = np.array(values, dtype=np.int64)
    except OverflowError:  # a Python int past int64: negative ones stay negative
        ids = np.array([max(min(int(t), INT64_MAX), -1) for t in values], dtype=np.int64)
    bad = first(ids < 0) if vocab_size is None else first((ids < 0) | (ids >= vocab_size))
    if bad is not None:
        value = values[bad]
        where = field(bad) if callable(field) else f"{field}[{bad}]"
        if vocab_size is None:
            raise InputError(where, f"negative token id {value}")
        raise InputError(where, f"token id {value} out of range [0, {vocab_size})")
    return ids


def token_field(model_input: Tokens, field: str) -> Callable[[int], str]:
    """Position k of the model input's tokens -> its field,
    `{field}.chunks[j].encoded_text.tokens[i]` (token i of chunk j)."""
    ends = np.cumsum(model_input.chunk_lengths())

    def name(k: int) -> str:
        j = int(np.searchsorted(ends, k, side="right"))
        start = int(ends[j - 1]) if j else 0
        return f"{field}.chunks[{j}].encoded_text.tokens[{k - start}]"

    return name


def check_has_tokens(count: int, field: str) -> None:
    if count == 0:
        raise InputError(field, "has no tokens")
