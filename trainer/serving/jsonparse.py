"""What a decoded request body is made of: its errors, its bounds, its packed arrays.

The decoder itself is `trainer.serving.jsonscan`; the child process that runs it on large
bodies is `trainer.serving.bodychild`. Design notes: `docs/design/serving.md`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, BinaryIO, Protocol

import numpy as np

from trainer.contract.specs import chunk_datums

MAX_DEPTH = 64
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
_EXACT_FLOAT_INT = 1 << 53  # integers that float64 holds exactly

ANY = object()  # a path wildcard: any key or index
Pattern = tuple[Any, ...]
PACKED_PATHS: tuple[Pattern, ...] = (
    ("samples", ANY, "model_input", "chunks", ANY, "encoded_text", "tokens"),
    ("samples", ANY, "loss_fn_inputs", ANY, "data"),
    ("gradients", ANY, "data"),
    ("model_inputs", ANY, "chunks", ANY, "encoded_text", "tokens"),
    ("forward_backward_input", "data", ANY, "model_input", "chunks", ANY, "tokens"),
    ("forward_backward_input", "data", ANY, "loss_fn_inputs", ANY, "data"),
    ("forward_input", "data", ANY, "model_input", "chunks", ANY, "tokens"),
    ("forward_input", "data", ANY, "loss_fn_inputs", ANY, "data"),
)

# packed array dtypes, one letter each on the child's reply
KINDS: dict[str, np.dtype[Any]] = {
    "i": np.dtype("<i8"),
    "f": np.dtype("<f8"),
    "F": np.dtype("<f4"),
    "I": np.dtype("<i4"),
}
_KIND_OF = {dtype: kind for kind, dtype in KINDS.items()}


class BodyError(ValueError):
    """A body refused. `kind`: invalid_json (message = the decoder's), not_object, field
    (message names the path, `param` is it); and, not the body's fault: memory, storage,
    missing (file gone), crash, timeout, busy."""

    def __init__(self, kind: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "message": self.message, "param": self.param}


def field_error(param: str, message: str) -> BodyError:
    """A 400 naming `param`; the message starts with it."""
    return BodyError("field", f"{param}: {message}", param)


@dataclass(frozen=True)
class Bounds:
    """What one body may hold, checked while it is decoded, before anything is allocated:
    the model limits (the largest of the configured models; the rulebook checks the model's
    own afterwards), how many loss inputs a sample names, and how many values (JSON values
    outside numeric arrays, protobuf fields) the whole body has."""

    max_batch_size: int = 1 << 16
    max_seq_length: int = 1 << 20
    max_tokens_per_call: int = 1 << 24
    max_inputs: int = 64
    max_items: int = 1 << 20

    @classmethod
    def of_models(cls, models: Iterable[ModelLimits]) -> Bounds:
        entries = list(models)
        if not entries:
            return cls()
        batch = max(m.max_batch_size for m in entries)
        return cls(
            max_batch_size=batch,
            max_seq_length=max(m.max_seq_length for m in entries),
            max_tokens_per_call=max(m.max_tokens_per_call for m in entries),
            max_items=min(ITEMS_PER_SAMPLE * chunk_datums(batch) + (1 << 16), 1 << 20),
        )

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


ITEMS_PER_SAMPLE = 64


class ModelLimits(Protocol):
    """The limits of a configured model (`trainer.contract.specs.ModelEntry`)."""

    @property
    def max_batch_size(self) -> int: ...
    @property
    def max_seq_length(self) -> int: ...
    @property
    def max_tokens_per_call(self) -> int: ...


def format_path(parts: list[Any] | tuple[Any, ...]) -> str:
    """`["samples", 0, "model_input"]` -> `samples[0].model_input` (as the 400s spell it)."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def too_deep(parts: list[Any]) -> BodyError:
    where = format_path(parts) or "body"
    return field_error(where, f"JSON nested deeper than {MAX_DEPTH} levels")


def out_of_range(parts: list[Any], text: str) -> BodyError:
    digits = len(text.lstrip("-"))
    shown = text if digits <= 24 else f"{text[:12]}...({digits} digits)"
    where = format_path(parts) or "body"
    return field_error(where, f"integer {shown} is outside the int64 range [-2**63, 2**63-1]")


def matches(parts: list[Any], patterns: tuple[Pattern, ...]) -> bool:
    for pattern in patterns:
        if len(pattern) == len(parts) and all(
            p is ANY or p == q for p, q in zip(pattern, parts, strict=True)
        ):
            return True
    return False


def check_ints(items: list[Any], parts: list[Any]) -> None:
    """The first integer of `items` outside int64, refused by its index."""
    for index, item in enumerate(items):
        if type(item) is int and not INT64_MIN <= item <= INT64_MAX:
            raise out_of_range([*parts, index], str(item))


def pack(items: list[Any], floats: bool) -> np.ndarray | None:
    """A list of numbers as the int64/float64 array holding exactly the same values, or None."""
    kinds = set(map(type, items))
    if kinds == {int}:
        return np.array(items, dtype=np.int64)  # in range: `check_ints` ran first
    if floats and kinds == {float}:
        return np.array(items, dtype=np.float64)
    if floats and kinds == {int, float}:
        ints = [x for x in items if type(x) is int]
        if min(ints) >= -_EXACT_FLOAT_INT and max(ints) <= _EXACT_FLOAT_INT:
            return np.array(items, dtype=np.float64)
    return None


class Packer:
    """Appends packed arrays to one binary file (each at an 8-byte boundary); remembers where
    each one belongs."""

    def __init__(self, handle: BinaryIO) -> None:
        self.handle = handle
        self.paths: list[str] = []
        self.kinds: list[str] = []
        self.counts: list[int] = []
        self._offset = 0

    def add(self, parts: list[Any], array: np.ndarray) -> None:
        array = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
        self.handle.write(array.data)
        pad = -array.nbytes % 8
        self.handle.write(b"\0" * pad)
        self._offset += array.nbytes + pad
        self.paths.append(json.dumps(parts, separators=(",", ":")))
        self.kinds.append(_KIND_OF[array.dtype])
        self.counts.append(int(array.shape[0]))

    def pack_all(self, value: Any, parts: list[Any]) -> None:
        """Every 1-D numpy array inside `value` (dicts and lists), packed and set to None."""
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in list(items):
            if isinstance(item, np.ndarray) and item.ndim == 1 and item.dtype in _KIND_OF:
                self.add([*parts, key], item)
                value[key] = None
            elif isinstance(item, dict | list):
                self.pack_all(item, [*parts, key])

    def reply(self) -> dict[str, Any]:
        return {"paths": self.paths, "kinds": "".join(self.kinds), "counts": self.counts}
