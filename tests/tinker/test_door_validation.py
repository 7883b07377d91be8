"""Bad input is refused at the door, on both faces: a token id at or past the vocabulary (the
int32 maximum included), or a float that is infinite once float32, is a 400 naming the field as
its face spells it (a Tinker chunk's `tokens[k]`, the RL face's `encoded_text.tokens[k]`), for
training samples and sample prompts alike, and leaves no future, operation or trace.

Everything goes over TCP to the real app and engine (`serve_in_thread`)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.conftest import LiveServer, serve_in_thread
from tests.conftest import VOCAB
from tests.faults.procs import ce_sample, new_resource, new_session
from tests.tinker import tinker_http as th

INT32_MAX = 2**31 - 1
FBI = "forward_backward_input.data"


@pytest.fixture(scope="module")
def live(tiny_qwen_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    storage = tmp_path_factory.mktemp("door")
    model = [{"name": th.BASE, "location": str(tiny_qwen_dir), "max_seq_length": 4096}]
    with serve_in_thread(storage, {}, model=model, max_body_bytes=1 << 24) as server:
        yield server


def _chunks(*parts: list[int]) -> dict[str, Any]:
    return {"chunks": [{"type": "encoded_text", "tokens": part} for part in parts]}


def _fb(model_id: str, datum: dict[str, Any], forward_only: bool = False) -> dict[str, Any]:
    body = th.fb_body(model_id, forward_only)
    body["forward_backward_input"]["data"] = [th.datum(), datum]
    return body


def _two_chunk_datum(first: list[int], second: list[int]) -> dict[str, Any]:
    datum = th.datum([*first, *second, 4])
    datum["model_input"] = _chunks(first, second)
    return datum


def _post_op(http: httpx.Client, url: str, body: dict[str, Any]) -> httpx.Response:
    return http.post(url, json=body, headers={"Idempotency-Key": str(uuid.uuid4())})


def _refused(response: httpx.Response, field: str) -> None:
    """A 400 whose param is `field` (up to a ": " that names a place within it) and whose
    message starts with `field`."""
    assert response.status_code == 400, (field, response.status_code, response.text[:300])
    error = response.json()["error"]
    param = field.split(": ")[0]
    assert error["param"] == param and error["message"].startswith(f"{field}: "), error


def tinker_cases(model_id: str) -> list[tuple[str, dict[str, Any], str]]:
    long = list(range(1, 100)) * 5  # a 495-token datum (the tiny model takes 512), bad at its end
    big = th.datum([*long, VOCAB, 5])
    sample = {"base_model": th.BASE, "sampling_params": {"max_tokens": 2}}
    weights = th.datum()
    weights["loss_fn_inputs"]["weights"]["data"][1] = 1e39
    targets = th.datum()
    targets["loss_fn_inputs"]["target_tokens"]["data"][1] = VOCAB
    return [
        (
            "/forward_backward",
            _fb(model_id, _two_chunk_datum([3, 4], [5, 6, VOCAB])),
            f"{FBI}[1].model_input.chunks[1].tokens[2]",
        ),
        (
            "/forward_backward",
            _fb(model_id, _two_chunk_datum([3, 4, INT32_MAX], [5]), forward_only=True),
            f"{FBI}[1].model_input.chunks[0].tokens[2]",
        ),
        ("/forward_backward", _fb(model_id, big), f"{FBI}[1].model_input.chunks[0].tokens[495]"),
        ("/forward_backward", _fb(model_id, weights), f"{FBI}[1].loss_fn_inputs.weights.data[1]"),
        ("/forward_backward", _fb(model_id, targets), f"{FBI}[1].loss_fn_inputs.target_tokens[1]"),
        (
            "/asample",
            {**sample, "prompt": _chunks([1, 2], [3, VOCAB])},
            "prompt.chunks[1].tokens[1]",
        ),
        ("/asample", {**sample, "prompt": _chunks([INT32_MAX])}, "prompt.chunks[0].tokens[0]"),
    ]


def test_tinker_face_refuses_bad_ids_and_floats_at_the_door(
    live: LiveServer, http: httpx.Client, model: str
) -> None:
    th.ok(http, "/forward_backward", th.fb_body(model, forward_only=True))  # the model is loaded
    before, records = th.fingerprint(live, model), th.records(live)
    cases = tinker_cases(model)
    for route, body, field in cases:
        _refused(http.post(route, json=body), field)
    # concurrent clients, each with its own bad request, all refused the same way
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda c: http.post(c[0], json=c[1]), cases * 3))
    for response, (_, _, field) in zip(responses, cases * 3, strict=True):
        _refused(response, field)
    assert th.records(live) == records, "a refused request left a future or a record"
    assert th.fingerprint(live, model) == before, "a refused request changed the model"


def test_rl_face_refuses_bad_ids_and_floats_at_the_door(live: LiveServer) -> None:
    with live.client() as http:
        rid = new_resource(http, th.BASE)
        sid = new_session(http, rid, lora_config={"rank": 2, "seed": 0})
        two_chunks = ce_sample([3, 4, 5, 6, 7])
        two_chunks["model_input"]["chunks"] = [
            {"encoded_text": {"tokens": [3, 4]}},
            {"encoded_text": {"tokens": [5, VOCAB]}},
        ]
        heavy = ce_sample([*list(range(1, 100)) * 5, 5])
        heavy["model_input"]["chunks"][0]["encoded_text"]["tokens"][400] = INT32_MAX
        weights = ce_sample([3, 4, 5], weights=[1.0, 1e39])
        where = "samples[1].model_input.chunks"
        loss = {"type": "LOSS_TYPE_CROSS_ENTROPY"}
        cases = [
            ("forward-backward", two_chunks, f"{where}[1].encoded_text.tokens[1]"),
            ("forward-backward", heavy, f"{where}[0].encoded_text.tokens[400]"),
            # a tensor's own check: the tensor is the param, its value's place leads the message
            ("forward-backward", weights, "samples[1].loss_fn_inputs.weights: data[1]"),
        ]
        url = f"/rl/training-sessions/{sid}/operations"
        for kind, bad, field in cases:
            body = {"loss": loss, "samples": [ce_sample([1, 2, 3]), bad]}
            _refused(_post_op(http, f"{url}/{kind}", body), field)
        prompts = [
            {"chunks": [{"encoded_text": {"tokens": [1]}}]},
            {
                "chunks": [
                    {"encoded_text": {"tokens": [1, 2]}},
                    {"encoded_text": {"tokens": [VOCAB]}},
                ]
            },
        ]
        body = {"model_inputs": prompts, "sampling_params": {"max_tokens": 2}}
        _refused(
            _post_op(http, f"{url}/sample", body),
            "model_inputs[1].chunks[1].encoded_text.tokens[0]",
        )
        engine = live.worker.sessions[sid].engine
        assert int(engine.step) == 0  # nothing reached the session
