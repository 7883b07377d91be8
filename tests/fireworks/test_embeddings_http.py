"""Embedding calls over raw HTTP as the Fireworks SDK sends them (docs/semantics.md §27): each bad
request a 400 naming its field in the request's own names, frozen references, another user's
model."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.fireworks import test_data_plane_http as dp
from tests.fireworks.test_data_plane_http import error, model
from tests.tinker import tinker_http as th

# the two users' server and clients (module fixtures of the data-plane tests)
adapters, live, alice, bob = dp.adapters, dp.live, dp.alice, dp.bob

pytestmark = pytest.mark.fireworks

SEQS = [[3, 17, 22, 9], [8, 21, 33], [4, 19, 7, 5], [11, 26, 14, 2]]


def text(tokens: list[int], **inputs: list[float]) -> dict[str, Any]:
    return {
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
        "loss_fn_inputs": {name: th.tensor(v, "float32") for name, v in inputs.items()},
    }


def body(model_id: str, config: dict[str, Any], data: list[dict] | None = None, fb: bool = False):
    key = "forward_backward_input" if fb else "forward_input"
    data = data if data is not None else [text(s) for s in SEQS]
    return {
        "model_id": model_id,
        key: {"data": data, "loss_fn": "cross_entropy", "loss_fn_config": config},
    }


CONTRASTIVE = {
    "output": "contrastive_loss",
    "num_queries": 2,
    "temperature": 0.05,
    "pooling": "last",
}


def test_embedding_requests_answer_the_vectors_and_refuse_bad_fields(alice: httpx.Client) -> None:
    m = model(alice, lora_config={"rank": 2, "seed": 0})
    vectors = th.ok(alice, "/forward", body(m, {"output": "embedding", "pooling": "mean"}))
    outputs = vectors["loss_fn_outputs"]
    assert len(outputs) == 4 and all(len(o["embedding"]["data"]) == 64 for o in outputs)
    fb = th.ok(alice, "/forward_backward", body(m, CONTRASTIVE, fb=True))
    assert set(fb["metrics"]) >= {"loss:sum", "in_batch_recall_at_1:mean"}, fb
    cases = [
        ({"output": "projection"}, None, False, "forward_input.loss_fn_config.output"),
        ({"output": "embedding", "beta": 1.0}, None, False, "forward_input.loss_fn_config.beta"),
        (
            {"output": "embedding", "pooling": "max"},
            None,
            False,
            "forward_input.loss_fn_config.pooling",
        ),
        ({**CONTRASTIVE, "num_queries": 3}, None, True, "forward_backward_input.data"),
        (
            {"output": "contrastive_loss", "num_queries": 2},
            None,
            True,
            "forward_backward_input.loss_fn_config.temperature",
        ),
        (
            {"output": "embedding"},
            None,
            True,
            "forward_backward_input.data[0].loss_fn_inputs.embedding_grads",
        ),
        (
            {"output": "cos_similarity_matrix"},
            [text(s, embedding_grads=[0.5] * 3) for s in SEQS],
            True,
            "forward_backward_input.data[0].loss_fn_inputs.embedding_grads.data",
        ),
        (
            CONTRASTIVE,
            [text(s, weights=[1.0] * len(s)) for s in SEQS],
            True,
            "forward_backward_input.data[0].loss_fn_inputs.weights",
        ),
    ]
    for config, data, is_fb, param in cases:
        path = "/forward_backward" if is_fb else "/forward"
        err = error(alice.post(path, json=body(m, config, data, is_fb)))
        assert err["param"] == param, (config, err)
    wrong_ce = body(m, {"output": "embedding"})
    wrong_ce["forward_input"]["loss_fn"] = "ppo"
    assert error(alice.post("/forward", json=wrong_ce))["param"] == "forward_input.loss_fn"
    # the hidden size is the model's (64): a 400 once a resource of the model has loaded
    short = [text(s, embedding_grads=[0.5] * 63) for s in SEQS]
    err = error(alice.post("/forward_backward", json=body(m, {"output": "embedding"}, short, True)))
    assert err["param"] == "forward_backward_input.data[0].loss_fn_inputs.embedding_grads.data"
    assert "of hidden size 64" in err["message"], err


def test_a_frozen_reference_embeds_but_does_not_train(alice: httpx.Client) -> None:
    base = model(alice, base_only=True)
    lora = model(alice, lora_config={"rank": 2, "seed": 0})  # B = 0: the base model too
    config = {"output": "embedding", "pooling": "last"}
    assert th.ok(alice, "/forward", body(base, config)) == th.ok(
        alice, "/forward", body(lora, config)
    )
    err = error(alice.post("/forward_backward", json=body(base, CONTRASTIVE, fb=True)))
    assert err["param"] == "model_id" and "frozen reference" in err["message"], err


def test_another_users_model_answers_as_a_missing_one(
    alice: httpx.Client, bob: httpx.Client
) -> None:
    mine = model(alice, lora_config={"rank": 2, "seed": 0})
    gone = mine.replace(mine.split(":")[0], "session_" + "0" * 32)
    a = bob.post("/forward_backward", json=body(mine, CONTRASTIVE, fb=True))
    b = bob.post("/forward_backward", json=body(gone, CONTRASTIVE, fb=True))
    assert a.status_code == b.status_code == 404
    assert a.json()["error"]["message"].replace(mine, "<id>") == b.json()["error"][
        "message"
    ].replace(gone, "<id>")
