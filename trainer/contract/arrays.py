"""Numeric fields of wire specs that hold a JSON list or a packed numpy array.

Large request bodies reach validation with their bulk lists already packed into 1-D int64 or
float64 arrays (`trainer.serving.jsonparse`): `TensorData.data`, chunk `tokens` and `Gradient.data`.
An `ArrayOrList` field passes such an array through without a Python object per element; the
spec's own validator then checks it vectorised, with the messages of the list path (`data[7]:
is not finite`). A list takes the list path. `model_dump` writes arrays back as lists.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from pydantic import GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import core_schema

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
NumArray = npt.NDArray[Any]
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

Accepts = Literal["ints", "numbers", "floats"]


class ArrayOrList:
    """`Annotated[list[...] | NDArray, ArrayOrList(list[...], accepts)]`.

    accepts: "ints" (integer arrays, kept int64), "numbers" (integer or float arrays, kept as
    they are), "floats" (integer or float arrays, made float64). Any other array goes through
    the list schema as a list, so it gets the list path's checks and messages.
    """

    def __init__(self, inner: Any, accepts: Accepts) -> None:
        self.inner = inner
        self.accepts = accepts

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        accepts = self.accepts

        def validate(value: Any, inner: core_schema.ValidatorFunctionWrapHandler) -> Any:
            if isinstance(value, np.ndarray):
                packed = _accept(value, accepts)
                return packed if packed is not None else inner(value.tolist())
            return inner(value)

        return core_schema.no_info_wrap_validator_function(
            validate,
            handler.generate_schema(self.inner),
            serialization=core_schema.plain_serializer_function_ser_schema(_as_list),
        )

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        return handler(schema)


def _as_list(value: Any) -> Any:
    return value.tolist() if isinstance(value, np.ndarray) else value


def _accept(array: NumArray, accepts: Accepts) -> NumArray | None:
    if array.ndim != 1 or array.dtype.kind not in "iuf":
        return None
    if array.dtype.kind == "u" and array.size and int(array.max()) > INT64_MAX:
        return None
    if array.dtype.kind in "iu":
        return array.astype(np.float64 if accepts == "floats" else np.int64, copy=False)
    return array.astype(np.float64, copy=False) if accepts != "ints" else None


def first(mask: npt.NDArray[np.bool_]) -> int | None:
    """Index of the first True, or None."""
    hits = np.flatnonzero(mask)
    return int(hits[0]) if hits.size else None


def tensor_values(data: NumArray, dtype: str) -> NumArray:
    """A packed `TensorData.data` checked for its dtype: int64 values (integral floats are
    converted, as `int(value)` converts a listed one) or float64 values (cast to float32 later;
    their finiteness is a rule, `trainer.contract.rules.check_finite`)."""
    if dtype == "int64":
        if data.dtype.kind != "f":
            return data
        bad = first(~(np.isfinite(data) & (data == np.trunc(data))))
        if bad is not None:
            raise ValueError(f"data[{bad}] = {float(data[bad])} is not an integer (dtype int64)")
        # 2**63 is exactly representable; anything from there on is past int64
        bad = first((data < -(2.0**63)) | (data >= 2.0**63))
        if bad is not None:
            raise ValueError(f"data[{bad}] = {float(data[bad])} is outside the int64 range")
        return data.astype(np.int64)
    return data.astype(np.float64, copy=False)


def as_int64(values: Sequence[int] | NumArray) -> IntArray:
    """Token ids as int64 (OverflowError for a Python int past int64)."""
    return np.asarray(values, dtype=np.int64)


def as_float32(values: Sequence[float | int | str] | NumArray) -> npt.NDArray[np.float32]:
    """float32 through float64, as `torch.tensor([float(v) ...], dtype=float32)` rounds."""
    return np.asarray(values, dtype=np.float64).astype(np.float32)
