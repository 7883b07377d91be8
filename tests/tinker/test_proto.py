"""The Tinker face's protobuf codec against the `tinker` SDK's own serialiser and deserialiser.

The reference is the SDK (0.38, in its own venv; see `tests/tinker/venv.py`): one subprocess per
module builds requests with `forward_backward_request_to_proto` and reads our response bytes with
`deserialize_proto_response`. Arrays cross the process boundary as raw bytes (base64 in JSON).
"""

from __future__ import annotations

import base64
import json
import subprocess
import time
from typing import Any

import numpy as np
import pytest

from tests.tinker.venv import tinker_python
from trainer.api.tinker.proto import (
    PROTOBUF,
    ProtoError,
    decode_forward_backward_request,
    encode_forward_backward_output,
    encode_sample_response,
)


def _pack(array: np.ndarray) -> dict[str, Any]:
    array = np.ascontiguousarray(array)
    raw = base64.b64encode(array.tobytes()).decode()
    return {"raw": raw, "dtype": array.dtype.str, "shape": list(array.shape)}


_SDK_SCRIPT = r"""
import base64, json, sys
import numpy as np, torch
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_proto_response

def unpack(d):
    a = np.frombuffer(base64.b64decode(d["raw"]), dtype=d["dtype"])
    return a.reshape(d["shape"]).copy()

def b64(raw):
    return base64.b64encode(raw).decode()

def request(spec):
    data, sparse = [], []
    for d in spec["datums"]:
        chunks = []
        for c in d["chunks"]:
            if c["type"] == "image":
                chunks.append(types.ImageChunk(data=bytes(c["size"]), format=c["format"]))
            else:
                chunks.append(types.EncodedTextChunk(tokens=unpack(c["tokens"]).tolist()))
        inputs = {}
        for name, t in d["inputs"].items():
            array = unpack(t)
            if t.get("sparse"):
                td = types.TensorData.from_torch_sparse(torch.from_numpy(array))
                sparse.append(td.sparse_crow_indices is not None)
            else:
                td = types.TensorData.from_numpy(array)
            inputs[name] = td
        datum = types.Datum(model_input=types.ModelInput(chunks=chunks), loss_fn_inputs=inputs)
        if d.get("provenance"):
            n = datum.model_input.length
            datum = datum.with_provenance(
                model_input=[types.PromptProvenanceSpan(sequence_id="s0", length=n)],
                loss_fn_inputs=[types.SampledProvenanceSpan(sequence_id="s1", offset=2, length=n)],
            )
        data.append(datum)
    fbi = types.ForwardBackwardInput(
        data=data, loss_fn=spec["loss_fn"], loss_fn_config=spec["loss_fn_config"]
    )
    req = types.ForwardBackwardRequest(
        forward_backward_input=fbi, model_id=spec["model_id"], seq_id=spec["seq_id"]
    )
    msg = forward_backward_request_to_proto(req)
    msg.forward_only = spec["forward_only"]
    return {"body": b64(msg.SerializeToString()), "sparse": sparse}

def tensor(td):
    a = td.to_numpy()
    return {"dtype": td.dtype, "shape": td.shape, "np_dtype": a.dtype.str, "data": a.tolist()}

def topk(rows):
    return None if rows is None else [None if r is None else [list(p) for p in r] for r in rows]

def fb_output(raw):
    out = deserialize_proto_response(base64.b64decode(raw), types.ForwardBackwardOutput)
    return {
        "loss_fn_output_type": out.loss_fn_output_type,
        "metrics": out.metrics,
        "loss_fn_outputs": [{k: tensor(v) for k, v in d.items()} for d in out.loss_fn_outputs],
    }

def sample(raw):
    out = deserialize_proto_response(base64.b64decode(raw), types.SampleResponse)
    return {
        "sequences": [
            {"tokens": s.tokens, "logprobs": s.logprobs, "stop_reason": s.stop_reason,
             "topk_logprobs": topk(s.topk_logprobs)}
            for s in out.sequences
        ],
        "prompt_logprobs": out.prompt_logprobs,
        "topk_prompt_logprobs": topk(out.topk_prompt_logprobs),
        "prompt_cache_hit_tokens": out.prompt_cache_hit_tokens,
    }

job = json.load(sys.stdin)
json.dump({
    "requests": [request(s) for s in job["requests"]],
    "fb_outputs": [fb_output(r) for r in job["fb_outputs"]],
    "samples": [sample(r) for r in job["samples"]],
}, sys.stdout)
"""


def _run_sdk(job: dict[str, Any]) -> dict[str, Any]:
    done = subprocess.run(
        [str(tinker_python()), "-c", _SDK_SCRIPT],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


rng = np.random.default_rng(13)
_SPARSE_WEIGHTS = np.zeros((6, 10), dtype=np.float32)
_SPARSE_WEIGHTS[[0, 2, 2, 5], [1, 0, 9, 4]] = [0.5, -1.25, 3.0, 2.0]

# datum -> chunks (token arrays or image markers) and loss_fn_inputs (arrays, sparse flag)
_DATUMS: list[dict[str, Any]] = [
    {
        "chunks": [np.array([1, 2, 3], np.int64), np.array([2**31 - 1, 0], np.int64)],
        "inputs": {
            "target_tokens": rng.integers(0, 50_000, 5),
            "weights": rng.random(5, dtype=np.float32),
        },
        "provenance": True,  # Datum fields 3 and 4: unknown to us, skipped
    },
    {
        "chunks": [np.array([7], np.int64), {"type": "image", "format": "png", "size": 11}],
        "inputs": {
            "target_tokens": rng.integers(0, 9, (4, 3)),  # 2-D int64
            "advantages": rng.standard_normal(4).astype(np.float32),
            "logprobs": -rng.random(4, dtype=np.float32),
        },
    },
    {
        "chunks": [rng.integers(0, 1000, 6)],
        "inputs": {"weights": _SPARSE_WEIGHTS, "target_tokens": np.arange(6)},
        "sparse": {"weights"},
    },
]
_REQUEST = {
    "model_id": "model-7",
    "seq_id": 42,
    "forward_only": True,
    "loss_fn": "ppo",
    "loss_fn_config": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.3, "mode": "tok"},
}
_LARGE = {"datums": 64, "tokens": 4096}


def _request_spec(datums: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    wire = []
    for d in datums:
        chunks = [
            c if isinstance(c, dict) else {"type": "text", "tokens": _pack(c)} for c in d["chunks"]
        ]
        inputs = {
            n: {**_pack(a), "sparse": n in d.get("sparse", ())} for n, a in d["inputs"].items()
        }
        wire.append({"chunks": chunks, "inputs": inputs, "provenance": d.get("provenance", False)})
    return {**_REQUEST, **extra, "datums": wire}


def _large_datums() -> list[dict[str, Any]]:
    big = np.random.default_rng(0)
    n = _LARGE["tokens"]
    return [
        {
            "chunks": [big.integers(0, 150_000, n)],
            "inputs": {
                "target_tokens": big.integers(0, 150_000, n),
                "weights": big.random(n, dtype=np.float32),
            },
        }
        for _ in range(_LARGE["datums"])
    ]


_FB_OUTPUTS: list[dict[str, Any]] = [
    {
        "loss_fn_output_type": "ArrayRecord",
        "loss_fn_outputs": [
            {"logprobs": rng.standard_normal(5).astype(np.float32), "ids": np.arange(5)},
            {"logprobs": rng.standard_normal(3).astype(np.float32), "ids": np.arange(3) + 9},
            # a new trailing shape starts a new ArrayRecord
            {"logprobs": rng.standard_normal((2, 4)).astype(np.float32), "ids": np.arange(2)},
            {"logprobs": np.zeros(0, np.float32), "ids": np.zeros(0, np.int64)},
            {"logprobs": rng.standard_normal(7), "ids": np.array([-3, 2**40])},  # float64 -> f32
        ],
        "metrics": {"loss:sum": 1.25, "tiny": -3e-300, "zero": 0.0},
    },
    {"loss_fn_output_type": "x.y:TorchLossReturn", "loss_fn_outputs": [{}, {}], "metrics": {}},
    {"loss_fn_output_type": "ArrayRecord", "loss_fn_outputs": [], "metrics": {"a": 1.0}},
]
_SAMPLES: list[dict[str, Any]] = [
    {
        "sequences": [
            {"tokens": [5, 6, 2**31 - 1], "logprobs": [-0.1, -2.5, -1e-9], "stop_reason": "stop"},
            {
                "tokens": [0, 1],
                "logprobs": None,
                "stop_reason": "length",
                "topk_logprobs": [[(4, -0.25), (9, -1.5)], None],
            },
        ],
        "prompt_logprobs": [None, -1.5, -0.25, None, -7.0],
        "topk_prompt_logprobs": [None, [(3, -0.1), (5, -2.0)], [(7, -0.5)], None, [(1, -3.0)]],
        "prompt_cache_hit_tokens": 4,
    },
    {"sequences": [{"tokens": [], "logprobs": None, "stop_reason": "length"}]},
    {
        "sequences": [],
        "prompt_logprobs": [None, None],
        "topk_prompt_logprobs": [None, None],
        "prompt_cache_hit_tokens": 0,
    },
]


@pytest.fixture(scope="module")
def sdk() -> dict[str, Any]:
    """Everything the SDK answers, in one venv subprocess."""
    job = {
        "requests": [_request_spec(_DATUMS), _request_spec(_large_datums(), loss_fn_config=None)],
        "fb_outputs": [
            base64.b64encode(encode_forward_backward_output(o)).decode() for o in _FB_OUTPUTS
        ],
        "samples": [base64.b64encode(encode_sample_response(s)).decode() for s in _SAMPLES],
    }
    return _run_sdk(job)


def _body(sdk: dict[str, Any], index: int) -> bytes:
    return base64.b64decode(sdk["requests"][index]["body"])


def test_sdk_request_decodes_to_the_same_numbers(sdk: dict[str, Any]) -> None:
    assert PROTOBUF == "application/x-protobuf"
    assert sdk["requests"][0]["sparse"] == [True]  # the SDK really sent CSR for "weights"
    # unknown top-level fields (varint, fixed64, length-delimited, fixed32, a group) are skipped
    unknown = (
        b"\xc8\x06\x96\x01" + b"\xd1\x06" + bytes(8) + b"\xda\x06\x02ab" + b"\xe5\x06" + bytes(4)
    )
    unknown += b"\xeb\x06" + b"\x08\x01" + b"\xec\x06"  # group 109 holding field 1 = 1
    got = decode_forward_backward_request(_body(sdk, 0) + unknown)
    assert (got["model_id"], got["seq_id"], got["forward_only"]) == ("model-7", 42, True)
    fbi = got["forward_backward_input"]
    assert fbi["loss_fn"] == "ppo"
    assert fbi["loss_fn_config"] == _REQUEST["loss_fn_config"]
    assert len(fbi["data"]) == len(_DATUMS)
    for datum, want in zip(fbi["data"], _DATUMS, strict=True):
        chunks = datum["model_input"]["chunks"]
        assert len(chunks) == len(want["chunks"])
        for chunk, c in zip(chunks, want["chunks"], strict=True):
            if isinstance(c, dict):
                assert chunk == {"type": "image", "format": c["format"], "data_bytes": c["size"]}
            else:
                assert chunk == {"type": "encoded_text", "tokens": c.tolist()}
        assert sorted(datum["loss_fn_inputs"]) == sorted(want["inputs"])
        for name, array in want["inputs"].items():
            tensor = datum["loss_fn_inputs"][name]
            dtype = "float32" if array.dtype.kind == "f" else "int64"
            assert tensor["dtype"] == dtype and tensor["data"].dtype == np.dtype(dtype)
            assert tensor["shape"] == list(array.shape) and tensor["data"].ndim == 1
            np.testing.assert_array_equal(tensor["data"], array.reshape(-1).astype(dtype))


def test_large_request_decodes_fast(sdk: dict[str, Any]) -> None:
    body = _body(sdk, 1)
    elapsed = float("inf")
    for _ in range(3):  # the best of three: a pause of a loaded machine is not the decoder's
        start = time.perf_counter()
        got = decode_forward_backward_request(body)
        elapsed = min(elapsed, time.perf_counter() - start)
    want = _large_datums()
    data = got["forward_backward_input"]["data"]
    assert got["forward_backward_input"]["loss_fn_config"] is None
    assert len(data) == _LARGE["datums"]
    for datum, w in zip(data, want, strict=True):
        assert datum["model_input"]["chunks"][0]["tokens"] == w["chunks"][0].tolist()
        for name in ("target_tokens", "weights"):
            np.testing.assert_array_equal(datum["loss_fn_inputs"][name]["data"], w["inputs"][name])
    # 64 x 4096 tokens + 2 tensors each (4 MB) take ~15 ms here, numpy-bound; a Python loop
    # over the 786k numbers would take longer than this bound
    assert elapsed < 0.25, f"decoding took {elapsed:.2f}s"


def _np_tensor(t: dict[str, Any]) -> np.ndarray:
    return np.asarray(t["data"], dtype=t["np_dtype"]).reshape(t["shape"])


def test_forward_backward_output_reads_back_through_the_sdk(sdk: dict[str, Any]) -> None:
    for sent, got in zip(_FB_OUTPUTS, sdk["fb_outputs"], strict=True):
        assert got["loss_fn_output_type"] == sent["loss_fn_output_type"].rsplit(":", 1)[-1]
        assert got["metrics"] == sent["metrics"]
        assert len(got["loss_fn_outputs"]) == len(sent["loss_fn_outputs"])
        for g, s in zip(got["loss_fn_outputs"], sent["loss_fn_outputs"], strict=True):
            assert sorted(g) == sorted(s)
            for name, array in s.items():
                dtype = "float32" if array.dtype.kind == "f" else "int64"
                assert g[name]["dtype"] == dtype and g[name]["shape"] == list(array.shape)
                np.testing.assert_array_equal(_np_tensor(g[name]), array.astype(dtype))


def _f32(x: float | None) -> float | None:
    return None if x is None else float(np.float32(x))


def _topk(rows: list[Any] | None) -> list[Any] | None:
    if rows is None:
        return None
    return [None if r is None else [[t, _f32(lp)] for t, lp in r] for r in rows]


def test_sample_response_reads_back_through_the_sdk(sdk: dict[str, Any]) -> None:
    for sent, got in zip(_SAMPLES, sdk["samples"], strict=True):
        assert len(got["sequences"]) == len(sent["sequences"])
        for g, s in zip(got["sequences"], sent["sequences"], strict=True):
            assert g["tokens"] == s["tokens"] and g["stop_reason"] == s["stop_reason"]
            want_lp = None if s["logprobs"] is None else [_f32(x) for x in s["logprobs"]]
            assert g["logprobs"] == want_lp
            assert g["topk_logprobs"] == _topk(s.get("topk_logprobs"))
        want = sent.get("prompt_logprobs")
        assert got["prompt_logprobs"] == (None if want is None else [_f32(x) for x in want])
        assert got["topk_prompt_logprobs"] == _topk(sent.get("topk_prompt_logprobs"))
        assert got["prompt_cache_hit_tokens"] == sent.get("prompt_cache_hit_tokens", 0)


# --- malformed bodies, built by hand from the encoding spec --------------------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes(out + bytes([n]))


def _len(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _tensor_body(
    dtype: int, shape: list[int], dense: bytes | None = None, csr: bytes = b""
) -> bytes:
    """A request with one datum whose loss_fn_inputs["w"] is the given Tensor."""
    packed = b"".join(_varint(n & (2**64 - 1)) for n in shape)
    tensor = (_len(1, dense) if dense is not None else _len(2, csr)) + b"\x18" + _varint(dtype)
    tensor += _len(4, packed)
    return _len(3, _len(2, _len(1, b"w") + _len(2, tensor)))


_MALFORMED: list[tuple[bytes, str]] = [
    (b"\x80", "body"),  # truncated varint
    (b"\x10" + b"\xff" * 10 + b"\x01", "seq_id"),  # an 11-byte varint
    (b"\x1a" + _varint(2**40), "data"),  # a length claiming 2**40 bytes
    (b"\x1a\x05\x0a\x02", "data"),  # a length past the end
    (b"\x08\x01", "model_id"),  # wrong wire type (varint for a string)
    (b"\x0a\x02\xff\xfe", "model_id"),  # not UTF-8
    (b"\x00\x01", "body"),  # field number 0
    (b"\x7f", "body.<field 15>"),  # wire type 7
    (b"\xa4\x01", "body.<field 20>"),  # an end-group with no start
    (b"\xa3\x01\x08\x01", "body.<field 20>"),  # a group never closed
    (b"\x1c", "data"),  # a group where a message belongs
    (_len(3, _len(1, _len(1, _len(1, b"abc")))), "data[0].model_input[0].encoded_text.tokens"),
    (_len(3, _len(1, b"")), "data[0].model_input[0]"),  # a chunk with nothing set
    (_tensor_body(9, [2], bytes(8)), "data[0].loss_fn_inputs['w'].dtype"),
    (_tensor_body(0, [2], bytes(8)), "data[0].loss_fn_inputs['w'].dtype"),
    (_tensor_body(1, [3], bytes(8)), "data[0].loss_fn_inputs['w'].dense"),
    (_tensor_body(2, [-1], bytes(8)), "data[0].loss_fn_inputs['w'].shape"),
    (_tensor_body(1, [2], bytes(7)), "data[0].loss_fn_inputs['w'].dense"),
    (_tensor_body(1, [4], csr=b""), "data[0].loss_fn_inputs['w'].shape"),  # CSR needs 2-D
    # CSR: crow [0, 2] but only one value; a column out of range; densify to 2**40 cells
    (
        _tensor_body(1, [1, 3], csr=_len(1, bytes(4)) + _len(2, np.array([0, 2]).tobytes())),
        "data[0].loss_fn_inputs['w'].sparse_csr",
    ),
    (
        _tensor_body(
            1,
            [1, 3],
            csr=_len(1, bytes(4))
            + _len(2, np.array([0, 1]).tobytes())
            + _len(3, np.array([3]).tobytes()),
        ),
        "data[0].loss_fn_inputs['w'].sparse_csr.col_indices",
    ),
    (
        _tensor_body(1, [1, 2**40], csr=_len(2, np.array([0, 0]).tobytes())),
        "data[0].loss_fn_inputs['w']",
    ),
    (_len(7, _len(1, b"k")), "loss_fn_config_v2['k']"),  # a config value with neither arm
]


@pytest.mark.parametrize(("body", "field"), _MALFORMED)
def test_malformed_bodies_name_the_field(body: bytes, field: str) -> None:
    with pytest.raises(ProtoError) as err:
        decode_forward_backward_request(body)
    assert err.value.field == field
    assert isinstance(err.value, ValueError) and str(err.value).startswith(field)


def test_hand_built_body_decodes_unpacked_shape_and_merged_messages() -> None:
    # shape sent unpacked (one varint each), and the map entry's Tensor split in two parts,
    # which protobuf merges (a singular message seen twice)
    part_a = _len(1, np.array([1.5, -2.0], "<f4").tobytes()) + b"\x18\x01"
    part_b = b"\x20\x01\x20\x02"
    chunk = _len(1, _len(1, np.array([9, -8], "<i4").tobytes()))
    body = _len(3, _len(1, chunk) + _len(2, _len(1, b"w") + _len(2, part_a) + _len(2, part_b)))
    body += b"\x10" + _varint(2**64 - 5)  # seq_id -5 as protobuf writes a negative int32
    got = decode_forward_backward_request(body)
    datum = got["forward_backward_input"]["data"][0]
    assert got["seq_id"] == -5 and got["model_id"] == "" and got["forward_only"] is False
    assert got["forward_backward_input"]["loss_fn_config"] is None
    assert datum["model_input"]["chunks"] == [{"type": "encoded_text", "tokens": [9, -8]}]
    w = datum["loss_fn_inputs"]["w"]
    assert w["shape"] == [1, 2] and w["dtype"] == "float32"
    np.testing.assert_array_equal(w["data"], np.array([1.5, -2.0], np.float32))


def test_truncated_and_random_bodies_raise_only_proto_error(sdk: dict[str, Any]) -> None:
    good = _body(sdk, 0)
    bodies = [good[:n] for n in range(len(good))]
    fuzz = np.random.default_rng(1234)
    bodies += [fuzz.bytes(int(fuzz.integers(1, 80))) for _ in range(3000)]
    for _ in range(1500):  # the valid body with a few bytes changed
        mutated = bytearray(good)
        for at in fuzz.integers(0, len(good), int(fuzz.integers(1, 4))):
            mutated[at] = int(fuzz.integers(0, 256))
        bodies.append(bytes(mutated))
    errors = 0
    for body in bodies:
        try:
            decode_forward_backward_request(body)
        except ProtoError:
            errors += 1
    assert errors > len(good) // 2  # most cuts land inside a field
