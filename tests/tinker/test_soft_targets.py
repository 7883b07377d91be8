"""`cross_entropy` with `target_tokens` and `weights` of shape (N, K) on the Tinker face: the
top-K distillation datums of tinker-cookbook's SDFT (docs/semantics.md §1, §18).

Over TCP to the real app and engine (`serve_in_thread`), as JSON and as the SDK's protobuf
(dense tensors, and the sparse CSR encoding the SDK picks for mostly-zero 2-D `target_tokens`
and `weights`): a forward returns `logprobs` of shape (N, K), each the log softmax of the base
model at that target (a plain transformers forward is the reference; a new LoRA adapter's B is
0), and `loss:sum` is `Σ_t Σ_k −w_tk·lp_tk`. Bad shapes are 400s naming the field, with no
trace left.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from tests.api.conftest import LiveServer
from tests.conftest import VOCAB
from tests.tinker import tinker_http as th
from trainer.api.tinker import proto
from trainer.api.tinker.protowire import write_message

FBI = "forward_backward_input.data"
TOKENS = [3, 17, 42, 9, 77, 5, 11]  # model input: all but the last; the K targets are ours


def table(seed: int, k: int, n: int = len(TOKENS) - 1) -> tuple[np.ndarray, np.ndarray]:
    """[N, K] targets (distinct per row) and weights: softmax rows, a few zero rows, zeros in
    the last column of every other row (the padding of a teacher's short top-K)."""
    rng = np.random.default_rng(seed)
    targets = np.stack([rng.permutation(VOCAB)[:k] for _ in range(n)]).astype(np.int64)
    weights = rng.random((n, k))
    weights = np.exp(weights) / np.exp(weights).sum(-1, keepdims=True)
    weights[:2] = 0.0
    weights[::2, -1] = 0.0
    targets[::2, -1] = 0
    return targets, weights.astype(np.float32)


def datum(targets: np.ndarray, weights: np.ndarray | None) -> dict[str, Any]:
    inputs = {"target_tokens": _json(targets, "int64")}
    if weights is not None:
        inputs["weights"] = _json(weights, "float32")
    return {
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": TOKENS[:-1]}]},
        "loss_fn_inputs": inputs,
    }


def _json(array: np.ndarray, dtype: str) -> dict[str, Any]:
    return {"data": array.reshape(-1).tolist(), "dtype": dtype, "shape": list(array.shape)}


def fb(model_id: str, data: list[dict[str, Any]], forward_only: bool = True) -> dict[str, Any]:
    return {
        "model_id": model_id,
        "forward_backward_input": {"data": data, "loss_fn": "cross_entropy"},
        "forward_only": forward_only,
    }


@pytest.fixture(scope="module")
def reference_lp(tiny_qwen_dir: Path) -> np.ndarray:
    """log softmax of the served base model's logits at every model-input position: [N, V]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([TOKENS[:-1]])).logits[0].float()
    return torch.log_softmax(logits, -1).double().numpy()


def _outputs(result: dict[str, Any]) -> list[np.ndarray]:
    return [
        np.asarray(out["logprobs"]["data"], dtype=np.float64).reshape(out["logprobs"]["shape"])
        for out in result["loss_fn_outputs"]
    ]


def test_forward_returns_n_by_k_logprobs_and_the_soft_loss(
    http: httpx.Client, model: str, reference_lp: np.ndarray
) -> None:
    targets, weights = table(0, k=5)
    result = th.ok(http, "/forward_backward", fb(model, [datum(targets, weights)]))
    (lp,) = _outputs(result)
    want = np.take_along_axis(reference_lp, targets, axis=1)
    assert lp.shape == targets.shape == (len(TOKENS) - 1, 5)
    np.testing.assert_allclose(lp, want, rtol=1e-5, atol=1e-5)  # every position and column
    loss = float(-(weights * want).sum())
    assert result["metrics"]["loss:sum"] == pytest.approx(loss, rel=1e-5)
    assert result["metrics"]["loss/tokens:sum"] == len(TOKENS) - 3  # rows with a weight


def test_omitted_weights_are_ones_of_the_targets_shape(
    http: httpx.Client, model: str, reference_lp: np.ndarray
) -> None:
    targets, _ = table(1, k=3)
    result = th.ok(http, "/forward_backward", fb(model, [datum(targets, None)]))
    want = np.take_along_axis(reference_lp, targets, axis=1)
    assert result["metrics"]["loss:sum"] == pytest.approx(float(-want.sum()), rel=1e-5)


def _proto_tensor(array: np.ndarray, sparse: bool) -> dict[str, Any]:
    kind = proto.DTYPE_INT64 if array.dtype.kind == "i" else proto.DTYPE_FLOAT32
    wire = "<i8" if kind == proto.DTYPE_INT64 else "<f4"
    if not sparse:
        return {"dense": array.astype(wire).tobytes(), "dtype": kind, "shape": list(array.shape)}
    rows, cols = np.nonzero(array)  # zeros left out, as `TensorData.from_torch_sparse` does
    crow = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=array.shape[0]))])
    return {
        "sparse_csr": {
            "values": array[rows, cols].astype(wire).tobytes(),
            "crow_indices": crow.astype("<i8").tobytes(),
            "col_indices": cols.astype("<i8").tobytes(),
        },
        "dtype": kind,
        "shape": list(array.shape),
    }


def fb_proto(
    model_id: str,
    targets: np.ndarray,
    weights: np.ndarray,
    sparse: bool,
    tokens: list[int] = TOKENS[:-1],
) -> bytes:
    msg = {
        "model_id": model_id,
        "seq_id": 0,
        "loss_fn": "cross_entropy",
        "forward_only": True,
        "data": [
            {
                "model_input": [{"encoded_text": {"tokens": np.array(tokens, "<i4").tobytes()}}],
                "loss_fn_inputs": {
                    "target_tokens": _proto_tensor(targets, sparse),
                    "weights": _proto_tensor(weights, sparse),
                },
            }
        ],
    }
    return write_message(msg, proto.FORWARD_BACKWARD_REQUEST)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse-csr"])
def test_protobuf_bodies_dense_and_sparse(
    http: httpx.Client, model: str, reference_lp: np.ndarray, sparse: bool
) -> None:
    targets, weights = table(2, k=4)
    body = fb_proto(model, targets, weights, sparse)
    response = http.post(
        "/forward_backward", content=body, headers={"content-type": proto.PROTOBUF}
    )
    assert response.status_code == 200, response.text
    result = th.wait(http, response.json()["request_id"])
    (lp,) = _outputs(result)
    want = np.take_along_axis(reference_lp, targets, axis=1)
    np.testing.assert_allclose(lp, want, rtol=1e-5, atol=1e-5)
    loss = float(-(weights.astype(np.float64) * want).sum())
    assert result["metrics"]["loss:sum"] == pytest.approx(loss, rel=1e-5)


def _bad(targets: Any, weights: Any, t_shape: Any, w_shape: Any) -> dict[str, Any]:
    d = datum(np.zeros((1, 1), np.int64), np.zeros((1, 1), np.float32))
    d["loss_fn_inputs"] = {
        "target_tokens": {"data": targets, "dtype": "int64", "shape": t_shape},
        "weights": {"data": weights, "dtype": "float32", "shape": w_shape},
    }
    return d


N = len(TOKENS) - 1
IDS = list(range(2 * N))
ONES = [1.0] * (2 * N)
D0 = f"{FBI}[0].loss_fn_inputs"


@pytest.mark.parametrize(
    ("loss_fn", "data", "field"),
    [
        ("cross_entropy", [_bad(IDS, [1.0] * N, [N, 2], [N])], f"{D0}.weights.shape"),
        ("cross_entropy", [_bad(IDS, ONES, [N, 2], [2, N])], f"{D0}.weights.shape"),
        ("cross_entropy", [_bad([], [], [N, 0], [N, 0])], f"{D0}.target_tokens.shape"),
        ("cross_entropy", [_bad(IDS[:-2], ONES[:-2], [N - 1, 2], [N - 1, 2])],
         f"{D0}.target_tokens.shape"),
        ("cross_entropy", [_bad(IDS, ONES, [N, 3], [N, 2])], f"{D0}.target_tokens.shape"),
        ("cross_entropy", [_bad([*IDS[:-1], VOCAB], ONES, [N, 2], [N, 2])],
         f"{D0}.target_tokens[{N - 1}][1]"),
        ("cross_entropy", [_bad([0] * N * 129, [1.0] * N * 129, [N, 129], [N, 129])],
         f"{D0}.target_tokens.shape"),
        ("cross_entropy", [_bad(IDS, ONES, [N, 2], [N, 2]), th.datum(TOKENS)],
         f"{FBI}[1].loss_fn_inputs.target_tokens.shape"),
        ("cross_entropy", [_bad(IDS, [*ONES[:-1], 1e39], [N, 2], [N, 2])],
         f"{D0}.weights.data[{2 * N - 1}]"),
        ("importance_sampling", [_bad(IDS, ONES, [N, 2], [N, 2])], f"{D0}.weights"),
    ],
    ids=["weights-1d", "transposed", "k0", "rows", "size", "vocab", "k129", "mixed", "inf", "is"],
)  # fmt: skip
def test_bad_shapes_are_400s_naming_the_field(
    live: LiveServer, http: httpx.Client, model: str, loss_fn: str, data: list, field: str
) -> None:
    before = th.fingerprint(live, model), th.records(live)
    body = fb(model, data, forward_only=False)
    body["forward_backward_input"]["loss_fn"] = loss_fn
    response = http.post("/forward_backward", json=body)
    assert response.status_code == 400, (field, response.status_code, response.text[:300])
    error = response.json()["error"]
    assert error["param"] == field and error["message"].startswith(f"{field}: "), error
    assert (th.fingerprint(live, model), th.records(live)) == before


def test_ppo_refuses_n_by_k_targets(http: httpx.Client, model: str) -> None:
    targets, _ = table(3, k=2)
    d = datum(targets, None)
    d["loss_fn_inputs"]["logprobs"] = _json(np.full(N, -1.0, np.float32), "float32")
    d["loss_fn_inputs"]["advantages"] = _json(np.ones(N, np.float32), "float32")
    body = fb(model, [d], forward_only=False)
    body["forward_backward_input"]["loss_fn"] = "ppo"
    response = http.post("/forward_backward", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == f"{D0}.target_tokens.shape", error
    assert "only cross entropy" in error["message"], error


@pytest.mark.parametrize("body", ["json", "proto"])
def test_n_times_k_values_may_exceed_max_seq_length(
    http: httpx.Client, model: str, tiny_qwen_dir: Path, body: str
) -> None:
    """The decoders bound a [T, K] tensor by K per token, not one: 400 positions x 20 targets
    (8000 values) on a model of 512 tokens."""
    n, k = 400, 20
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, VOCAB, n).tolist()
    targets = np.stack([rng.permutation(VOCAB)[:k] for _ in range(n)]).astype(np.int64)
    weights = np.full((n, k), 1.0 / k, np.float32)
    if body == "json":
        d = datum(targets, weights)
        d["model_input"]["chunks"][0]["tokens"] = tokens
        response = http.post("/forward_backward", json=fb(model, [d]))
    else:
        raw = fb_proto(model, targets, weights, sparse=False, tokens=tokens)
        response = http.post(
            "/forward_backward", content=raw, headers={"content-type": proto.PROTOBUF}
        )
    assert response.status_code == 200, response.text
    result = th.wait(http, response.json()["request_id"])
    (lp,) = _outputs(result)
    assert lp.shape == (n, k)
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_qwen_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = base(torch.tensor([tokens])).logits[0].float()
    want = torch.log_softmax(logits, -1).gather(-1, torch.from_numpy(targets)).double().numpy()
    np.testing.assert_allclose(lp, want, rtol=1e-5, atol=1e-5)


def test_the_rl_face_takes_the_same_soft_targets(
    live: LiveServer, reference_lp: np.ndarray
) -> None:
    """The RL face's cross entropy reads [T, K] `target_tokens` and `weights` too (an extension
    of its 1-D contract, docs/semantics.md §1); outputs carry their `shape`, and a position whose
    K weights are all 0 is masked (its row 0.0, §4)."""
    from tests.faults.procs import CE, new_resource, new_session, output

    targets, weights = table(6, k=3)
    sample = datum(targets, weights)
    sample["model_input"] = {"chunks": [{"encoded_text": {"tokens": TOKENS[:-1]}}]}
    with live.client() as http:
        sid = new_session(http, new_resource(http, th.BASE), lora_config={"rank": 2, "seed": 0})
        body = {
            "loss": CE,
            "samples": [sample],
            "forward_only": True,
            "return_loss_fn_outputs": True,
        }
        out = output(http, sid, "forward-backward", body)
    tensor = out["loss_fn_outputs"][0]["tensors"]["logprobs"]
    assert tensor["shape"] == [N, 3]
    lp = np.asarray(tensor["data"]).reshape(N, 3)
    want = np.take_along_axis(reference_lp, targets, axis=1)
    want[:2] = 0.0  # the rows of weight 0
    np.testing.assert_allclose(lp, want, rtol=1e-5, atol=1e-5)
    assert out["loss"] == pytest.approx(float(-(weights * want).sum()), rel=1e-5)
