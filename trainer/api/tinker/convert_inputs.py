"""The pieces of a Tinker request every conversion reads: numbers, token lists and tensors,
checked with a `TinkerInputError` that names the Tinker field (`trainer.api.tinker.convert`).

What these parse is judged by the engine's rules (`trainer.contract.rules`, the pydantic specs
of `trainer.contract`), run under the Tinker field names: `as_tinker` and `validated` re-raise
their refusals as `TinkerInputError`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

import numpy as np
from pydantic import BaseModel, ValidationError

from trainer.contract.errors import InputError
from trainer.contract.routing import FORMAT
from trainer.contract.rules import check_finite, check_has_tokens, check_ids
from trainer.serving.errors import field_path

Model = TypeVar("Model", bound=BaseModel)


class TinkerInputError(ValueError):
    """A Tinker request we cannot serve; `field` names the Tinker field, and so does the text."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@contextlib.contextmanager
def as_tinker() -> Iterator[None]:
    """A rule's refusal as a `TinkerInputError`, for a rule given the Tinker field's path."""
    try:
        yield
    except InputError as exc:
        raise TinkerInputError(exc.field, exc.detail) from None


def validated(
    spec: type[Model], data: Mapping[str, Any], where: str, names: Mapping[str, str] = {}
) -> Model:
    """`spec` validated from `data`; the first error becomes a `TinkerInputError` naming
    `{where}.<field>`, with `names` mapping the spec's top-level field names to Tinker's."""
    try:
        return spec.model_validate(data)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        loc = list(error["loc"])
        if loc:
            loc[0] = names.get(str(loc[0]), loc[0])
        path = field_path(loc, located=False)
        message = str(error["msg"]).removeprefix("Value error, ")
        raise TinkerInputError(f"{where}.{path}" if path else where, message) from None


def number(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TinkerInputError(field, f"must be a number, got {value!r}")
    if not math.isfinite(value):
        raise TinkerInputError(field, "must be finite")
    return float(value)


def flag(value: Any, field: str) -> bool:
    """A JSON boolean: "no", 0 and 1 are refused, not read as true or false."""
    if not isinstance(value, bool):
        raise TinkerInputError(field, f"must be a boolean (true or false), got {str(value)[:100]}")
    return value


def integer(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TinkerInputError(field, f"must be an integer, got {value!r}")
    return int(value)


def token_ids(model_input: Any, field: str, vocab_size: int | None = None) -> list[int]:
    """A Tinker `ModelInput` (`{"chunks": [...]}`) as its token ids; only text chunks, each id
    below `vocab_size` where it is known (else only not negative)."""
    if not isinstance(model_input, Mapping) or not isinstance(model_input.get("chunks"), list):
        raise TinkerInputError(field, "must be an object with a list of chunks")
    tokens: list[int] = []
    for j, chunk in enumerate(model_input["chunks"]):
        where = f"{field}.chunks[{j}]"
        if not isinstance(chunk, Mapping):
            raise TinkerInputError(where, "must be an object")
        kind = chunk.get("type", "encoded_text")
        if kind != "encoded_text":
            raise TinkerInputError(
                where, f"{kind!r} chunks are not supported (this worker serves text models)"
            )
        ids = chunk.get("tokens")
        if not isinstance(ids, list | np.ndarray):
            raise TinkerInputError(f"{where}.tokens", "must be a list of token ids")
        try:
            array = np.asarray(ids)
        except (TypeError, ValueError):
            raise TinkerInputError(f"{where}.tokens", "must be a list of token ids") from None
        if array.size and (array.ndim != 1 or array.dtype.kind not in "iu"):
            raise TinkerInputError(f"{where}.tokens", "must be a flat list of integer token ids")
        with as_tinker():
            ids = check_ids(array.astype(np.int64), f"{where}.tokens", vocab_size)
        tokens.extend(ids.tolist())
    with as_tinker():
        check_has_tokens(len(tokens), field)
    return tokens


def tensor_values(tensor: Any, field: str) -> np.ndarray:
    """A Tinker `TensorData` (`{"data", "dtype", "shape"}`) as a 1-D float64 array of finite
    values (row-major for a `[T, K]` shape: `table_shape`); how many there must be,
    and which inputs may be `[T, K]`, are rules (`trainer.contract.rules.check_inputs`)."""
    if not isinstance(tensor, Mapping) or "data" not in tensor:
        raise TinkerInputError(field, "must be a tensor object with data and dtype")
    if tensor.get("sparse_crow_indices") is not None or tensor.get("sparse_col_indices"):
        raise TinkerInputError(field, "sparse tensors are only accepted in the protobuf body")
    dtype = tensor.get("dtype")
    if dtype not in ("float32", "int64"):
        raise TinkerInputError(f"{field}.dtype", f"must be float32 or int64, got {dtype!r}")
    shape = tensor.get("shape")
    try:
        values = np.asarray(tensor["data"], dtype=np.float64)
    except (TypeError, ValueError, OverflowError):
        raise TinkerInputError(f"{field}.data", "must be a flat list of numbers") from None
    if values.ndim != 1:
        raise TinkerInputError(f"{field}.data", "must be a flat list of numbers")
    if shape is not None and shape != [values.size] and table_shape(shape, values.size) is None:
        raise TinkerInputError(
            f"{field}.shape",
            f"must be [{values.size}] (one value per token, 1-D) or [T, K] with T·K = "
            f"{values.size} (soft targets), got {str(shape)[:100]}",
        )
    with as_tinker():
        check_finite(values, f"{field}.data")
    return values


def table_shape(shape: Any, size: int) -> list[int] | None:
    """`[T, K]` when a tensor's `shape` is two non-negative integers whose product is its
    `size` (soft targets, row-major), else None."""
    if not isinstance(shape, list) or len(shape) != 2:
        return None
    if not all(isinstance(n, int | np.integer) and not isinstance(n, bool) for n in shape):
        return None
    rows, columns = int(shape[0]), int(shape[1])
    return [rows, columns] if min(rows, columns) >= 0 and rows * columns == size else None


def routing_matrices(model_input: Mapping[str, Any], field: str, count: int) -> list[str] | None:
    """A `ModelInput`'s R3 routes (the Fireworks SDK's `routing_matrices`): one base64 matrix
    per token, "" where the router keeps its own choice; None when it carries none. What a
    matrix must hold is the engine's check (`trainer.contract.routing`, docs/semantics.md
    §12); only the `base64_inline` format is read."""
    if model_input.get("routing_references") is not None or model_input.get(
        "routing_matrix_format"
    ) not in (None, FORMAT):
        raise TinkerInputError(
            f"{field}.routing_matrix_format",
            f"only {FORMAT} routing_matrices are read (create_model's routing_matrix_format)",
        )
    matrices = model_input.get("routing_matrices")
    if matrices is None:
        return None
    where = f"{field}.routing_matrices"
    if not isinstance(matrices, list) or not all(isinstance(m, str) for m in matrices):
        raise TinkerInputError(where, "must be a list of base64 strings, one per token")
    if len(matrices) != count:
        raise TinkerInputError(
            where, f"{len(matrices)} matrices for {count} tokens (one per model-input token)"
        )
    return matrices
