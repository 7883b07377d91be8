"""A request's identity on the Tinker face: who sent it and what it asked.

- Two clients that send ad-hoc samples of one base model under the same `seq_id` each get
  their own result (their own prompt, their own number of sequences), not the first one's.
- `X-Idempotency-Key`: the same key and body is the same future (run once); the same key with
  another body is a 409 naming the header; the same key on another model is that model's own
  request; a key over 256 characters is a 400 naming the header, never cut to fit.
- Protobuf `forward_backward` bodies without `seq_id` (proto3 sends 0) each run.
- `create_model` with a `model_seq_id` already used with another body is a 409 naming it.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.api.conftest import LiveServer
from tests.tinker import tinker_http as th
from trainer.api.tinker import proto

KEY = "X-Idempotency-Key"


def sample(tokens: list[int], count: int, seq_id: int | None = 0, **target: str) -> dict:
    body: dict[str, Any] = {
        **(target or {"base_model": th.BASE}),
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
        "num_samples": count,
        "prompt_logprobs": True,
        "sampling_params": {"max_tokens": 2, "seed": 1},
    }
    if seq_id is not None:
        body["seq_id"] = seq_id
    return body


def posted(http: httpx.Client, path: str, body: dict[str, Any], **headers: str) -> str:
    response = http.post(path, json=body, headers=headers)
    assert response.status_code == 200, response.text
    request_id: str = response.json()["request_id"]
    return request_id


def test_two_clients_on_one_adhoc_key_get_their_own_results(live: LiveServer) -> None:
    first, second = sample([3, 4], 1), sample([5, 6, 7, 8], 3)

    def one(body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        with th.client(live) as client:
            request_id = posted(client, "/asample", body)
            return request_id, th.wait(client, request_id)

    with ThreadPoolExecutor(2) as pool:
        (id_a, a), (id_b, b) = pool.map(one, [first, second])
    assert id_a != id_b
    assert len(a["sequences"]) == 1 and len(a["prompt_logprobs"]) == 2, a
    assert len(b["sequences"]) == 3 and len(b["prompt_logprobs"]) == 4, b
    # the same ad-hoc request again (a retry) is the same future
    with th.client(live) as client:
        assert posted(client, "/asample", second) == id_b


def test_one_idempotency_key_is_one_request_of_one_body(http: httpx.Client) -> None:
    model = th.new_model(http)
    first = posted(http, "/forward_backward", th.fb_body(model, True), **{KEY: "k-1"})
    assert posted(http, "/forward_backward", th.fb_body(model, True), **{KEY: "k-1"}) == first
    other = th.fb_body(model, True)
    other["forward_backward_input"]["data"] = [th.datum([3, 17, 42, 9])]
    response = http.post("/forward_backward", json=other, headers={KEY: "k-1"})
    assert response.status_code == 409, response.text
    error = response.json()["error"]
    assert error["param"] == KEY and error["code"] == "idempotency_key_reused", error
    assert error["message"].startswith(f"{KEY}: "), error
    assert "error" not in th.wait(http, first)
    # the same key on another model is that model's own request
    another = th.new_model(http)
    theirs = posted(http, "/forward_backward", th.fb_body(another, True), **{KEY: "k-1"})
    assert theirs != first
    assert len(th.logprobs(th.wait(http, theirs))) == len(th.TOKENS) - 1


def test_long_keys_are_refused_not_cut(http: httpx.Client) -> None:
    model = th.new_model(http)
    fits = posted(http, "/optim_step", th.optim_body(model), **{KEY: "a" * 256})
    assert "error" not in th.wait(http, fits)
    for path, body in (
        ("/optim_step", th.optim_body(model)),
        ("/forward_backward", th.fb_body(model)),
        ("/asample", sample([1, 2], 1)),
        ("/save_weights", {"model_id": model, "path": "long"}),
    ):
        response = http.post(path, json=body, headers={KEY: "a" * 257})
        assert response.status_code == 400, (path, response.text)
        assert response.json()["error"]["param"] == KEY
        th.check_refusal(response, KEY)


def test_protobuf_bodies_without_seq_id_each_run(live: LiveServer, http: httpx.Client) -> None:
    model = th.new_model(http)
    as_proto = {"content-type": proto.PROTOBUF}
    ids = []
    for _ in range(2):
        response = http.post(
            "/forward_backward", content=th.fb_proto(model, seq_id=0), headers=as_proto
        )
        assert response.status_code == 200, response.text
        ids.append(response.json()["request_id"])
    assert ids[0] != ids[1]
    first, second = (th.wait(http, request_id) for request_id in ids)
    assert "error" not in first and "error" not in second
    # two backward passes were accumulated: one optim step sees twice one pass's gradient
    step = th.ok(http, "/optim_step", th.optim_body(model))["metrics"]
    single = th.new_model(http)
    th.ok(http, "/forward_backward", th.fb_body(single))
    once = th.ok(http, "/optim_step", th.optim_body(single))["metrics"]
    assert step["grad_norm"] == pytest.approx(2 * once["grad_norm"], rel=1e-4)
    # with a seq_id, a retry of the same body is the same future
    retry = [
        http.post("/forward_backward", content=th.fb_proto(model, 7), headers=as_proto)
        for _ in range(2)
    ]
    assert retry[0].json()["request_id"] == retry[1].json()["request_id"]


def test_a_model_seq_id_reused_with_another_body_is_a_409(http: httpx.Client) -> None:
    session = th.new_session(http)
    body = {"session_id": session, "model_seq_id": 4, "base_model": th.BASE}
    first = posted(http, "/create_model", {**body, "lora_config": {"rank": 2}})
    assert posted(http, "/create_model", {**body, "lora_config": {"rank": 2}}) == first
    response = http.post("/create_model", json={**body, "lora_config": {"rank": 4}})
    assert response.status_code == 409, response.text
    assert response.json()["error"]["param"] == "model_seq_id"
    th.check_refusal(response, "model_seq_id")
    assert th.wait(http, first)["model_id"] == f"{session}:train:4"
    info = http.post("/get_info", json={"model_id": f"{session}:train:4"}).json()
    assert info["lora_rank"] == 2
