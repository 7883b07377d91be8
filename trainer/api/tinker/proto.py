"""The protobuf face of the Tinker API: the `tinker_public` messages the SDK sends and reads.

The `tinker` SDK (0.38) posts `forward_backward` as `application/x-protobuf` and, when it polls
a future with `Accept: application/x-protobuf`, reads `ForwardBackwardOutput` and
`SampleResponse` results as protobuf too. The messages (package `tinker_public`, proto3, field
numbers from the SDK's `tinker_public_pb2`) are declared below as tables for `protowire`.
Bulk numbers travel as raw little-endian bytes (`np.ndarray.tobytes()`), read with
`np.frombuffer`: tokens are int32, tensors float32 / int64 (int32 and bfloat16 are widened),
CSR indices int64.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from trainer.api.tinker.protowire import (
    Caps,
    Field,
    ProtoError,
    Schema,
    read_message,
    write_message,
)
from trainer.contract.losses import MAX_TARGET_COLUMNS
from trainer.serving.jsonparse import BodyError, Bounds

__all__ = [
    "PROTOBUF",
    "ProtoError",
    "decode_forward_backward_request",
    "decode_request_body",
    "encode_forward_backward_output",
    "encode_sample_response",
]

PROTOBUF = "application/x-protobuf"

MAX_DENSE_ELEMENTS = 1 << 25
"""Elements that densifying the sparse CSR tensors of one request may allocate, in all."""
MAX_DIMS = 8  # dimensions of one tensor's shape
MAX_CONFIG = 256  # entries of a loss_fn_config map
DECODER = "trainer.api.tinker.proto:decode_request_body"
"""The `ForwardBackwardRequest` decoder as the body parser names it (`trainer.serving.bodies`)."""


DTYPE_FLOAT32, DTYPE_INT64, DTYPE_INT32, DTYPE_BFLOAT16 = 1, 2, 3, 4
STOP_REASONS = {"stop": 0, "length": 1}

SPARSE_CSR: Schema = {
    1: Field("values", "bytes"),
    2: Field("crow_indices", "bytes"),
    3: Field("col_indices", "bytes"),
}
TENSOR: Schema = {
    1: Field("dense", "bytes", oneof="encoding"),
    2: Field("sparse_csr", "message", message=SPARSE_CSR, oneof="encoding"),
    3: Field("dtype", "enum"),
    4: Field("shape", "int64", repeated=True, cap="dims"),
}
CHUNK: Schema = {
    1: Field("encoded_text", "message", message={1: Field("tokens", "bytes")}, oneof="chunk"),
    2: Field(
        "image",
        "message",
        message={1: Field("data", "bytes"), 2: Field("format", "string")},
        oneof="chunk",
    ),
    3: Field("dmel", "message", message={}, oneof="chunk"),
}
SPAN_RUN: Schema = {
    1: Field("sequence_id", "string"),
    2: Field("offset", "int64"),
    3: Field("length", "int64"),
}
PROVENANCE_SPAN: Schema = {
    1: Field("prompt_tokens", "message", message=SPAN_RUN, oneof="span"),
    2: Field("sampled_tokens", "message", message=SPAN_RUN, oneof="span"),
}
DATUM: Schema = {
    1: Field("model_input", "message", repeated=True, message=CHUNK, cap="chunks"),
    2: Field("loss_fn_inputs", "map", value="message", message=TENSOR, cap="inputs"),
    3: Field("model_input_spans", "message", repeated=True, message=PROVENANCE_SPAN, cap="spans"),
    4: Field("loss_fn_input_spans", "message", repeated=True, message=PROVENANCE_SPAN, cap="spans"),
}
LOSS_CONFIG_VALUE: Schema = {
    1: Field("number", "double", oneof="value"),
    2: Field("text", "string", oneof="value"),
}
FORWARD_BACKWARD_REQUEST: Schema = {
    1: Field("model_id", "string"),
    2: Field("seq_id", "int32"),
    3: Field("data", "message", repeated=True, message=DATUM, cap="datums"),
    4: Field("loss_fn", "string"),
    5: Field("loss_fn_config", "map", value="double", cap="config"),
    6: Field("forward_only", "bool"),
    7: Field("loss_fn_config_v2", "map", value="message", message=LOSS_CONFIG_VALUE, cap="config"),
}

BATCHED_TENSOR: Schema = {
    1: Field("data", "bytes"),
    2: Field("offsets", "bytes"),
    3: Field("dtype", "enum"),
    4: Field("trailing_shape", "int64", repeated=True),
}
ARRAY_RECORD: Schema = {
    1: Field("type_tag", "string"),
    2: Field("fields", "map", value="message", message=BATCHED_TENSOR),
    3: Field("num_datums", "int64"),
}
FORWARD_BACKWARD_OUTPUT: Schema = {
    1: Field("loss_fn_output_type", "string"),
    2: Field("loss_fn_outputs", "message", repeated=True, message=ARRAY_RECORD),
    3: Field("metrics", "map", value="double"),
}
TOPK_LOGPROBS: Schema = {
    1: Field("token_ids", "bytes"),
    2: Field("logprobs", "bytes"),
    3: Field("k", "uint32"),
    4: Field("length", "uint32"),
}
SAMPLED_SEQUENCE: Schema = {
    1: Field("stop_reason", "enum"),
    2: Field("tokens", "bytes"),
    3: Field("logprobs", "bytes"),
    4: Field("topk_sampled_logprobs", "message", message=TOPK_LOGPROBS),
}
SAMPLE_RESPONSE: Schema = {
    1: Field("sequences", "message", repeated=True, message=SAMPLED_SEQUENCE),
    2: Field("prompt_logprobs", "bytes"),
    3: Field("topk_prompt_logprobs", "message", message=TOPK_LOGPROBS),
    4: Field("prompt_cache_hit_tokens", "int32"),
    5: Field("target_prompt_logprobs", "message", message=TENSOR),
    6: Field(
        "prompt_alt_tokens",
        "message",
        message={
            1: Field("tokens", "message", message=TENSOR),
            2: Field("logprobs", "message", message=TENSOR),
        },
    ),
}


_WIDE = {
    DTYPE_FLOAT32: ("<f4", "float32"),
    DTYPE_INT64: ("<i8", "int64"),
    DTYPE_INT32: ("<i4", "int64"),
    DTYPE_BFLOAT16: ("<u2", "float32"),
}


def _array(raw: memoryview, wire_dtype: str, path: str) -> np.ndarray:
    """Raw little-endian bytes as a fresh native 1-D array."""
    itemsize = np.dtype(wire_dtype).itemsize
    if len(raw) % itemsize:
        raise ProtoError(path, f"{len(raw)} bytes is not a whole number of {wire_dtype} values")
    return np.frombuffer(raw, dtype=wire_dtype).astype(wire_dtype[1:])


class _Limits:
    """The bounds of one decode, and what they counted so far."""

    def __init__(self, bounds: Bounds | None) -> None:
        self.bounds = bounds
        self.dense = MAX_DENSE_ELEMENTS  # elements densifying may still allocate
        self.tokens = 0

    def caps(self) -> Caps | None:
        b = self.bounds
        if b is None:
            return None
        counts = {
            "datums": b.max_batch_size,
            "chunks": b.max_seq_length,
            "spans": 2 * b.max_seq_length + 2,
            "inputs": b.max_inputs,
            "dims": MAX_DIMS,
            "config": MAX_CONFIG,
        }
        return Caps(fields=b.max_items, counts=counts)

    def values(self, count: int, path: str, shape: list[int]) -> None:
        """A tensor's element count, before it is allocated: at most one per token, or
        `MAX_TARGET_COLUMNS` per token for a 2-D (soft targets) shape."""
        if self.bounds is None:
            return
        per_token = MAX_TARGET_COLUMNS if len(shape) == 2 else 1
        if count > self.bounds.max_seq_length * per_token:
            limit = "max_seq_length" if per_token == 1 else f"{per_token} x max_seq_length"
            raise ProtoError(path, f"{count} values exceed {limit}")

    def datum_tokens(self, count: int, where: str) -> None:
        b = self.bounds
        if b is None:
            return
        if count > b.max_seq_length:
            raise ProtoError(
                f"{where}.model_input", f"{count} tokens exceed max_seq_length {b.max_seq_length}"
            )
        self.tokens += count
        if self.tokens > b.max_tokens_per_call:
            raise ProtoError(
                "data",
                f"at least {self.tokens} tokens in all exceed max_tokens_per_call "
                f"{b.max_tokens_per_call}; split the call",
            )


def _tensor(msg: dict[str, Any], path: str, limits: _Limits) -> dict[str, Any]:
    if msg["dtype"] not in _WIDE:
        raise ProtoError(f"{path}.dtype", f"unknown tensor dtype {msg['dtype']}")
    wire_dtype, dtype = _WIDE[msg["dtype"]]
    shape: list[int] = msg["shape"]
    if any(n < 0 for n in shape):
        raise ProtoError(f"{path}.shape", f"negative dimension in {shape}")
    size = int(np.prod(shape, dtype=object)) if shape else None
    csr = msg["sparse_csr"]
    if csr is None:
        dense = msg["dense"] or memoryview(b"")
        limits.values(len(dense) // np.dtype(wire_dtype).itemsize, f"{path}.dense", shape)
        values = _array(dense, wire_dtype, f"{path}.dense")
        if size is not None and values.size != size:
            raise ProtoError(f"{path}.dense", f"{values.size} values for shape {shape}")
    else:
        if len(shape) != 2:
            raise ProtoError(f"{path}.shape", f"a sparse CSR tensor needs a 2-D shape, got {shape}")
        assert size is not None
        limits.values(size, f"{path}.shape", shape)
        values = _densify(csr, shape, wire_dtype, f"{path}.sparse_csr", limits)
    if msg["dtype"] == DTYPE_BFLOAT16:
        values = (values.astype(np.uint32) << 16).view(np.float32)
    return {"data": values.astype(dtype, copy=False), "dtype": dtype, "shape": shape or None}


def _densify(
    csr: dict[str, Any], shape: list[int], wire_dtype: str, where: str, limits: _Limits
) -> np.ndarray:
    rows, cols = shape
    nonzero = _array(csr["values"], wire_dtype, f"{where}.values")
    crow = _array(csr["crow_indices"], "<i8", f"{where}.crow_indices")
    col = _array(csr["col_indices"], "<i8", f"{where}.col_indices")
    if crow.size != rows + 1 or crow[0] != 0 or np.any(np.diff(crow) < 0):
        raise ProtoError(f"{where}.crow_indices", f"not {rows + 1} row pointers from 0 up")
    if crow[-1] != nonzero.size or col.size != nonzero.size:
        raise ProtoError(where, "values, col_indices and crow_indices[-1] disagree")
    if col.size and (col.min() < 0 or col.max() >= cols):
        raise ProtoError(f"{where}.col_indices", f"a column outside [0, {cols})")
    limits.dense -= rows * cols
    if limits.dense < 0:
        tensor = where.removesuffix(".sparse_csr")
        raise ProtoError(tensor, f"densified tensors exceed {MAX_DENSE_ELEMENTS} elements")
    values = np.zeros(rows * cols, dtype=wire_dtype[1:])
    values[np.repeat(np.arange(rows), np.diff(crow)) * cols + col] = nonzero
    return values


def _chunk(msg: dict[str, Any], path: str, arrays: bool) -> dict[str, Any]:
    if msg["encoded_text"] is not None:
        tokens = _array(msg["encoded_text"]["tokens"], "<i4", f"{path}.encoded_text.tokens")
        ids = tokens.astype(np.int64) if arrays else tokens.tolist()
        return {"type": "encoded_text", "tokens": ids}
    if msg["image"] is not None:
        image = msg["image"]
        return {"type": "image", "format": image["format"], "data_bytes": len(image["data"])}
    if msg["dmel"] is not None:
        return {"type": "dmel"}
    raise ProtoError(path, "a chunk with none of encoded_text, image, dmel")


def _datum(datum: dict[str, Any], where: str, limits: _Limits, arrays: bool) -> dict[str, Any]:
    texts = [c["encoded_text"] for c in datum["model_input"] if c["encoded_text"] is not None]
    limits.datum_tokens(sum(len(t["tokens"]) // 4 for t in texts), where)
    chunks = [
        _chunk(c, f"{where}.model_input[{j}]", arrays) for j, c in enumerate(datum["model_input"])
    ]
    inputs = {
        name: _tensor(tensor, f"{where}.loss_fn_inputs[{name!r}]", limits)
        for name, tensor in datum["loss_fn_inputs"].items()
    }
    out: dict[str, Any] = {"model_input": {"chunks": chunks}, "loss_fn_inputs": inputs}
    for name in ("model_input_spans", "loss_fn_input_spans"):
        if datum[name]:  # proto3 cannot tell an empty list from none: both are absent
            out[name] = [_span(span, f"{where}.{name}[{j}]") for j, span in enumerate(datum[name])]
    return out


def _span(msg: dict[str, Any], path: str) -> dict[str, Any]:
    """A `ProvenanceSpan` as `trainer.api.tinker.stability` reads it: its one arm."""
    for arm in ("prompt_tokens", "sampled_tokens"):
        if msg[arm] is not None:
            return {arm: dict(msg[arm])}
    raise ProtoError(path, "a provenance span with neither prompt_tokens nor sampled_tokens")


def decode_forward_backward_request(
    body: bytes, bounds: Bounds | None = None, *, arrays: bool = False
) -> dict[str, Any]:
    """A protobuf `ForwardBackwardRequest` as the JSON shape of the SDK's request.

    Returns `{"model_id", "seq_id", "forward_only", "forward_backward_input": {"loss_fn",
    "loss_fn_config" (dict or None; `loss_fn_config_v2` wins, text values stay str),
    "data": [{"model_input": {"chunks": [...]}, "loss_fn_inputs": {name: {"data": 1-D numpy
    float32/int64, "dtype", "shape": list or None}}}]}}`. Chunks are `{"type": "encoded_text",
    "tokens": [...]}` (an int64 array with `arrays`), or image / dmel markers. Sparse CSR
    tensors come back dense. With `bounds`, datums, chunks, inputs, fields, tokens and tensor
    values are counted against them before they are allocated.
    Raises `ProtoError` (a `ValueError`) on any malformed or out-of-bounds body.
    """
    limits = _Limits(bounds)
    msg = read_message(body, FORWARD_BACKWARD_REQUEST, limits.caps())
    config: dict[str, Any] = dict(msg["loss_fn_config"])
    for key, value in msg["loss_fn_config_v2"].items():
        if value["number"] is not None:
            config[key] = value["number"]
        elif value["text"] is not None:
            config[key] = value["text"]
        else:
            raise ProtoError(f"loss_fn_config_v2[{key!r}]", "neither number nor text is set")
    data = [_datum(d, f"data[{i}]", limits, arrays) for i, d in enumerate(msg["data"])]
    return {
        "model_id": msg["model_id"],
        "seq_id": msg["seq_id"],
        "forward_only": msg["forward_only"],
        "forward_backward_input": {
            "loss_fn": msg["loss_fn"],
            "loss_fn_config": config or None,
            "data": data,
        },
    }


def decode_request_body(body: bytes, bounds: Bounds) -> dict[str, Any]:
    """`decode_forward_backward_request` within `bounds`, tokens as arrays, as the body
    parser calls it (`DECODER`): a malformed body is a `BodyError` naming the field."""
    try:
        return decode_forward_backward_request(body, bounds, arrays=True)
    except ProtoError as exc:
        raise BodyError("field", f"{exc.field}: {exc}", exc.field) from None


def _wire_dtype(array: np.ndarray) -> tuple[int, np.dtype]:
    if array.dtype.kind == "f":
        return DTYPE_FLOAT32, np.dtype("<f4")
    if array.dtype.kind in "iub":
        return DTYPE_INT64, np.dtype("<i8")
    raise ValueError(f"cannot send a {array.dtype} array as a Tinker tensor")


def _record(outputs: list[dict[str, np.ndarray]], type_tag: str) -> dict[str, Any]:
    """One ArrayRecord: each field's per-datum arrays concatenated, with byte offsets."""
    fields = {}
    for name in outputs[0]:
        arrays = [np.asarray(datum[name]) for datum in outputs]
        proto_dtype, wire_dtype = _wire_dtype(arrays[0])
        flat = [a.astype(wire_dtype).reshape(-1) for a in arrays]
        sizes = np.array([0] + [a.nbytes for a in flat], dtype=np.int64)
        fields[name] = {
            "data": b"".join(a.tobytes() for a in flat),
            "offsets": np.cumsum(sizes).astype("<i8").tobytes(),
            "dtype": proto_dtype,
            "trailing_shape": list(arrays[0].shape[1:]),
        }
    return {"type_tag": type_tag, "fields": fields, "num_datums": len(outputs)}


def encode_forward_backward_output(out: Mapping[str, Any]) -> bytes:
    """A `ForwardBackwardOutput` as the SDK's `deserialize_proto_response` reads it.

    `out` is `{"loss_fn_output_type": str, "loss_fn_outputs": [{name: numpy array}],
    "metrics": {str: float}}`; arrays are float (sent as float32) or integer (int64). Each run
    of datums whose fields keep one dtype and trailing shape is one ArrayRecord, so the SDK
    rebuilds every array's shape as `[leading, *trailing]` (a 0-d array comes back as `[1]`).
    """
    outputs = [{k: np.asarray(v) for k, v in datum.items()} for datum in out["loss_fn_outputs"]]
    names = list(outputs[0]) if outputs else []
    for i, datum in enumerate(outputs):
        if sorted(datum) != sorted(names):
            raise ValueError(f"loss_fn_outputs[{i}] has fields {sorted(datum)}, not {names}")

    def layout(datum: dict[str, np.ndarray]) -> list[tuple[int, tuple[int, ...]]]:
        return [(_wire_dtype(datum[n])[0], datum[n].shape[1:]) for n in names]

    records: list[dict[str, Any]] = []
    start = 0
    type_tag = out["loss_fn_output_type"]
    for end in range(1, len(outputs) + 1):
        if end == len(outputs) or layout(outputs[end]) != layout(outputs[start]):
            records.append(_record(outputs[start:end], type_tag))
            start = end
    message = {
        "loss_fn_output_type": type_tag,
        "loss_fn_outputs": records,
        "metrics": {k: float(v) for k, v in out.get("metrics", {}).items()},
    }
    return write_message(message, FORWARD_BACKWARD_OUTPUT)


_MASK_LOGPROB = -99999.0  # the SDK's sentinel for an empty top-k cell


def _int32_bytes(values: Any, what: str) -> bytes:
    array = np.asarray(values, dtype=np.int64).reshape(-1)
    if array.size and (array.min() < -(2**31) or array.max() >= 2**31):
        raise ValueError(f"{what} do not fit in int32")
    return array.astype("<i4").tobytes()


def _topk(rows: list[list[tuple[int, float]] | None], what: str) -> dict[str, Any]:
    """Rows of (token, logprob) pairs, or None, as the dense N x K sentinel-padded matrices."""
    k = max((len(row) for row in rows if row), default=0) or 1  # k = 0 would read back as None
    token_ids = np.zeros((len(rows), k), dtype=np.int64)
    logprobs = np.full((len(rows), k), _MASK_LOGPROB, dtype=np.float64)
    for i, row in enumerate(rows):
        for j, (token, logprob) in enumerate(row or ()):
            token_ids[i, j], logprobs[i, j] = token, logprob
    return {
        "token_ids": _int32_bytes(token_ids, f"{what} token ids"),
        "logprobs": logprobs.astype("<f4").tobytes(),
        "k": k,
        "length": len(rows),
    }


def _float32_bytes(values: list[float | None]) -> bytes:
    return np.array([np.nan if v is None else v for v in values], dtype="<f4").tobytes()


def encode_sample_response(resp: Mapping[str, Any]) -> bytes:
    """A `SampleResponse` as the SDK's `deserialize_proto_response` reads it.

    `resp` is `{"sequences": [{"tokens", "logprobs" (list or None), "stop_reason": "stop" |
    "length", optional "topk_logprobs"}], "prompt_logprobs" (list with None entries, or None),
    "topk_prompt_logprobs" (rows of (token, logprob) pairs or None, or None), optional
    "target_prompt_logprobs" and "prompt_alt_tokens" ({"tokens", "logprobs"}) as `TensorData`
    objects,
    "prompt_cache_hit_tokens"}`. None prompt logprobs travel as NaN, None top-k rows as
    sentinel rows; sequence ids are not on the wire (the SDK stamps them from the future).
    """
    sequences = []
    for i, seq in enumerate(resp["sequences"]):
        if seq["stop_reason"] not in STOP_REASONS:
            raise ValueError(f"sequences[{i}].stop_reason {seq['stop_reason']!r} is unknown")
        logprobs = seq.get("logprobs")
        topk = seq.get("topk_logprobs")
        sequences.append(
            {
                "stop_reason": STOP_REASONS[seq["stop_reason"]],
                "tokens": _int32_bytes(seq["tokens"], f"sequences[{i}].tokens"),
                "logprobs": None if logprobs is None else _float32_bytes(logprobs),
                "topk_sampled_logprobs": None if topk is None else _topk(topk, f"sequences[{i}]"),
            }
        )
    prompt_logprobs = resp.get("prompt_logprobs")
    topk_prompt = resp.get("topk_prompt_logprobs")
    target, alt = resp.get("target_prompt_logprobs"), resp.get("prompt_alt_tokens")
    message = {
        "sequences": sequences,
        "prompt_logprobs": None if prompt_logprobs is None else _float32_bytes(prompt_logprobs),
        "topk_prompt_logprobs": None if topk_prompt is None else _topk(topk_prompt, "prompt"),
        "prompt_cache_hit_tokens": int(resp.get("prompt_cache_hit_tokens", 0)),
        "target_prompt_logprobs": None if target is None else _tensor_message(target),
        "prompt_alt_tokens": None
        if alt is None
        else {
            "tokens": _tensor_message(alt["tokens"]),
            "logprobs": _tensor_message(alt["logprobs"]),
        },
    }
    return write_message(message, SAMPLE_RESPONSE)


def _tensor_message(tensor: Mapping[str, Any]) -> dict[str, Any]:
    """A `TensorData` object (float32 or int64; dense, or sparse CSR) as a `Tensor` message."""
    code, little = (DTYPE_INT64, "<i8") if tensor["dtype"] == "int64" else (DTYPE_FLOAT32, "<f4")
    values = np.asarray(tensor["data"], dtype=little).tobytes()
    out: dict[str, Any] = {"dtype": code, "shape": list(tensor["shape"])}
    if tensor.get("sparse_crow_indices") is None:
        out["dense"] = values
    else:
        out["sparse_csr"] = {
            "values": values,
            "crow_indices": np.asarray(tensor["sparse_crow_indices"], dtype="<i8").tobytes(),
            "col_indices": np.asarray(tensor["sparse_col_indices"], dtype="<i8").tobytes(),
        }
    return out
