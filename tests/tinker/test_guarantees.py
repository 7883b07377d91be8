"""The guarantees of the Tinker face (`/api/v1`), over plain HTTP against a live worker.

- Auth on every route the face mounts (enumerated from the app, so a new route cannot escape):
  401 without a key, with a wrong key, with a wrong `tml-` key; the token works as
  `X-API-Key: <token>`, `X-API-Key: tml-<token>` and `Authorization: Bearer <token>`.
- Unknown routes: a 404 naming the route; every route the SDK calls (read from the installed
  SDK's own source) is served or refused with a status the SDK does not retry.
- Malformed bodies on every POST route: a 4xx whose message names the field, never a 5xx, and
  no trace (the model's step, weights, gradients, checkpoints and the face's records unchanged).
- Futures: `try_again` while a request runs, then its result; idempotent retries (one
  `X-Idempotency-Key`, one run); finished futures survive a restart, pending ones fail cleanly;
  concurrent clients and many queued requests per model complete, in order, with the results
  of the same calls made one at a time.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pyrage
import pytest

from tests.api.conftest import TOKEN, LiveServer, serve_in_thread
from tests.tinker import tinker_http as th
from tests.tinker.venv import tinker_python
from trainer.api.tinker import proto, routes
from trainer.api.tinker.protowire import write_message
from trainer.engine.resource import COMPUTE_LOCK

BODY_MAX = 1 << 20
AGE = str(pyrage.x25519.Identity.generate().to_public())  # a valid age recipient
LIMITS = {"max_seq_length": 32, "max_batch_size": 4, "max_tokens_per_call": 96, "max_lora_rank": 8}
GOOD_AUTH = [
    {"X-API-Key": TOKEN},
    {"X-API-Key": f"tml-{TOKEN}"},
    {"Authorization": f"Bearer {TOKEN}"},
]
BAD_AUTH = [
    {},
    {"X-API-Key": "wrong-token"},
    {"X-API-Key": "tml-wrong-token"},
    {"X-API-Key": f"tml-{TOKEN}x"},
    {"Authorization": "Bearer tml-wrong-token"},
    {"Authorization": f"Basic {TOKEN}"},
]


@pytest.fixture(scope="module")
def live(tiny_qwen_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    storage = tmp_path_factory.mktemp("tinker-guarantees")
    model = [{"name": th.BASE, "location": str(tiny_qwen_dir), **LIMITS}]
    with serve_in_thread(storage, {}, model=model, max_body_bytes=BODY_MAX) as server:
        yield server


def concrete(path: str) -> str:
    """The path with its parameters filled (a checkpoint id has the shape `weights/<name>`)."""
    return re.sub(r"\{[^}]+\}", "x", path.replace("{checkpoint_id}", "weights/x"))


# -- 1. auth -------------------------------------------------------------------------------


def test_every_route_needs_the_token(live: LiveServer) -> None:
    mounted = th.face_routes(live.app)
    assert len(mounted) >= 25, mounted  # the enumeration found the face
    with httpx.Client(base_url=live.url, timeout=15) as raw:
        for method, path in mounted:
            url = concrete(path)
            body = {} if method in ("POST", "PUT", "PATCH") else None
            for headers in BAD_AUTH:
                response = raw.request(method, url, json=body, headers=headers)
                assert response.status_code == 401, (method, path, headers, response.text)
                assert "API key" in response.json()["error"]["message"]
            for headers in GOOD_AUTH:
                response = raw.request(method, url, json=body, headers=headers)
                assert response.status_code != 401, (method, path, headers, response.text)
                assert response.status_code < 500, (method, path, response.text)


def test_each_key_form_drives_a_request(live: LiveServer, model: str) -> None:
    for headers in GOOD_AUTH:
        with th.client(live, **headers) as client:
            assert client.post("/get_info", json={"model_id": model}).json()["model_id"] == model


# -- 2. unknown and unserved routes ----------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/api/v1/nope"),
        ("POST", "/api/v1/forwards"),
        ("POST", "/api/v1/a/b/c/d"),
        ("DELETE", "/api/v1/create_model/extra"),
        ("PATCH", "/api/v1/%E2%98%83"),
        ("GET", "/api/v1/" + "y" * 3000),
    ],
)
def test_unknown_routes_are_a_404_naming_them(live: LiveServer, method: str, path: str) -> None:
    with httpx.Client(base_url=live.url, headers=GOOD_AUTH[1], timeout=10) as raw:
        response = raw.request(method, path, json={})
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert httpx.URL(live.url + path).path[:200] in error["message"], error


def sdk_routes() -> set[tuple[str, str]]:
    """(method, path) of every call to /api/v1 in the installed SDK's source."""
    python = tinker_python()
    where = subprocess.run(
        [str(python), "-c", "import os, tinker; print(os.path.dirname(tinker.__file__))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    pattern = re.compile(r"\._?(get|post|put|patch|delete)\(\s*f?[\"'](/api/v1/[^\"']+)[\"']")
    found = set()
    for source in Path(where).rglob("*.py"):
        for verb, path in pattern.findall(source.read_text(errors="replace")):
            found.add((verb.upper(), path))
    return found


def test_every_sdk_route_is_served_or_refused_without_retries(live: LiveServer) -> None:
    """The SDK retries any 5xx (501 included) for five minutes (`execute_with_retries`): a
    route it knows must answer what it serves, or a 4xx naming the route, at once."""
    known = sdk_routes()
    assert len(known) >= 40, known
    with httpx.Client(base_url=live.url, headers=GOOD_AUTH[1], timeout=15) as raw:
        for method, path in sorted(known):
            url = concrete(path)
            body = {} if method in ("POST", "PUT", "PATCH") else None
            response = raw.request(method, url, json=body)
            assert response.status_code < 500, (method, path, response.text)
            assert "no such route" not in response.text, (method, path, response.text)
            if "not served" in response.text:
                assert url in response.json()["error"]["message"], response.text


# -- 3. malformed bodies ------------------------------------------------------------------


# (field to break, the value it gets, the name the refusal must carry); `None` drops it
BREAKS: dict[str, list[tuple[str, Any, str]]] = {
    "/create_session": [("tags", "x", "tags"), ("user_metadata", [1], "user_metadata")],
    "/session_heartbeat": [("session_id", None, "session_id"), ("session_id", 5, "session_id")],
    "/create_model": [
        ("session_id", None, "session_id"),
        ("base_model", None, "base_model"),
        ("base_model", "no-such-model", "base_model"),
        ("model_seq_id", "x", "model_seq_id"),
        ("model_seq_id", -1, "model_seq_id"),
        ("lora_config", {"rank": -1}, "lora_config"),
        ("lora_config", {"rank": 10**9}, "lora_config.rank"),
        ("lora_config", "x", "lora_config"),
    ],
    "/get_info": [("model_id", None, "model_id"), ("model_id", 5, "model_id")],
    "/weights_info": [
        ("tinker_path", None, "tinker_path"),
        ("tinker_path", "tinker://nope/weights/x", "tinker_path"),
        ("tinker_path", "s3://x", "tinker_path"),
    ],
    "/retrieve_future": [("request_id", None, "request_id"), ("request_id", [], "request_id")],
    "/forward_backward": [
        ("model_id", None, "model_id"),
        ("model_id", 7, "model_id"),
        ("forward_backward_input", None, "forward_backward_input"),
        ("forward_backward_input", "x", "forward_backward_input"),
        ("forward_backward_input", {"data": [], "loss_fn": "cross_entropy"}, "data"),
        ("forward_backward_input", {"data": [th.datum()], "loss_fn": "nope"}, "loss_fn"),
        ("forward_backward_input", {"data": [th.datum()], "loss_fn": 5}, "loss_fn"),
        ("forward_backward_input", {"data": "x", "loss_fn": "cross_entropy"}, "data"),
        ("forward_backward_input", {"data": [{}], "loss_fn": "cross_entropy"}, "data[0]"),
    ],
    "/forward": [
        ("model_id", None, "model_id"),
        ("forward_input", None, "forward_input"),
        ("forward_input", {"data": [th.datum()], "loss_fn": "nope"}, "loss_fn"),
        ("forward_input", {"data": [{}], "loss_fn": "cross_entropy"}, "data[0]"),
    ],
    "/load_adapter": [
        ("model_id", None, "model_id"),
        ("adapter_path", None, "adapter_path"),
        ("adapter_path", "gs://bucket/adapter", "adapter_path"),
        ("adapter_path", "accounts/a/models/nope", "adapter_path"),
    ],
    "/optim_step": [
        ("model_id", None, "model_id"),
        ("grad_accumulation_normalization", "mean", "grad_accumulation_normalization"),
        ("adam_params", None, "adam_params"),
        ("adam_params", "x", "adam_params"),
        ("adam_params", {"learning_rate": "x"}, "adam_params.learning_rate"),
        ("adam_params", {"learning_rate": -1.0}, "adam_params.learning_rate"),
        ("adam_params", {"beta1": 2.0}, "adam_params.beta1"),
        ("adam_params", {"lr": 1e-3}, "adam_params.lr"),
    ],
    "/save_weights": [
        ("model_id", None, "model_id"),
        ("path", "../escape", "path"),
        ("path", 5, "path"),
        ("ttl_seconds", -1, "ttl_seconds"),
    ],
    "/save_weights_for_sampler": [("model_id", None, "model_id"), ("path", "a/b", "path")],
    "/save_weights_external": [
        ("model_id", None, "model_id"),
        ("path", None, "path"),
        ("path", "..", "path"),
        ("age_encryption_recipients", ["age1x"], "age_encryption_recipients[0]"),
        ("age_encryption_recipients", [AGE, "ssh-ed25519 AAAA"], "age_encryption_recipients[1]"),
        ("age_encryption_recipients", ["AGE-SECRET-KEY-1X"], "age_encryption_recipients[0]"),
        ("age_encryption_recipients", [AGE, 5], "age_encryption_recipients[1]"),
        ("age_encryption_recipients", [], "age_encryption_recipients"),
        ("age_encryption_recipients", [AGE] * 11, "age_encryption_recipients"),
        ("age_encryption_recipients", AGE, "age_encryption_recipients"),
    ],
    "/load_weights": [
        ("path", None, "path"),
        ("path", "tinker://nope/weights/x", "path"),
        ("path", "/etc/passwd", "path"),
        ("model_id", None, "model_id"),
        ("optimizer", "x", "optimizer"),
    ],
    "/unload_model": [("model_id", None, "model_id"), ("model_id", "nope", "model_id")],
    "/copy_weights": [
        ("source_path", None, "source_path"),
        ("source_path", "tinker://nope/weights/x", "source_path"),
        ("source_path", "/etc/passwd", "source_path"),
        ("destination_project_id", None, "destination_project_id"),
        ("ttl_seconds", 60, "ttl_seconds"),
        ("weights_access_token", "t", "weights_access_token"),
    ],
    "/create_sampling_session": [
        ("session_id", None, "session_id"),
        ("sampling_session_seq_id", "x", "sampling_session_seq_id"),
        ("base_model", "no-such-model", "base_model"),
        ("base_model", None, "base_model"),
    ],
    "/asample": [
        ("prompt", None, "prompt"),
        ("prompt", {"chunks": [{"type": "encoded_text", "tokens": [-1]}]}, "prompt"),
        ("num_samples", 0, "num_samples"),
        ("num_samples", "x", "num_samples"),
        ("sampling_params", {"max_tokens": 0}, "sampling_params.max_tokens"),
        ("sampling_params", {"temperature": "hot"}, "sampling_params.temperature"),
        ("base_model", "no-such-model", "base_model"),
        ("topk_prompt_logprobs", 10**6, "topk_prompt_logprobs"),
        # the valid body asks for no prompt logprobs, which N needs; and its prompt has 2
        # tokens, so no N but 1 is in range
        ("prompt_logprobs_last_n", 1, "prompt_logprobs_last_n"),
        ("prompt_logprobs_last_n", "1", "prompt_logprobs_last_n"),
        ("prompt_logprobs_last_n", True, "prompt_logprobs_last_n"),
    ],
}
# POST routes that read no body (or refuse every request)
BODYLESS = {
    f"{th.PREFIX}{r}"
    for r in (
        "",
        "/",
        "/client/config",
        "/client/dynamic_config",
        "/telemetry",
        "/retrieve_futures",
    )
}
HUGE = "\U0001f600" * 300_000  # about 1.2 MB of UTF-8: past the JSON bodies' 1 MiB cap


def malformed_requests(
    valid: dict[str, dict[str, Any]],
) -> Iterator[tuple[str, bytes, dict[str, str], str | None]]:
    """(route, body bytes, headers, the field the refusal must name)."""
    as_json = {"content-type": "application/json"}
    for route, body in valid.items():
        yield route, b"{", as_json, "body"
        yield route, b"[1, 2]", as_json, None
        yield route, b"\xff\xfe not utf-8", as_json, "body"
        for field, value, name in BREAKS[route]:
            broken = {k: v for k, v in body.items() if k != field}
            if value is not None:
                broken[field] = value
            yield route, json.dumps(broken).encode(), as_json, name
        for field, value in body.items():
            if isinstance(value, str):  # a huge string in each string field
                yield route, json.dumps({**body, field: "z" * 100_000}).encode(), as_json, None


def proto_requests(model: str) -> Iterator[tuple[bytes, dict[str, str], str | None]]:
    """Protobuf `forward_backward` bodies that are garbage, truncated or mislabelled."""
    as_proto = {"content-type": proto.PROTOBUF}
    tokens = bytes(8 * 4)  # 8 int32 zeros
    good = write_message(
        {
            "model_id": model,
            "seq_id": 3,
            "loss_fn": "cross_entropy",
            "data": [{"model_input": [{"encoded_text": {"tokens": tokens}}], "loss_fn_inputs": {}}],
        },
        proto.FORWARD_BACKWARD_REQUEST,
    )
    yield b"\x00\x01garbage", as_proto, "body"
    for cut in (1, 5, len(good) // 2, len(good) - 1):
        yield good[:cut], as_proto, None
    yield good, as_proto, "target_tokens"  # decodes, but cross_entropy needs target_tokens
    yield json.dumps(th.fb_body(model)).encode(), as_proto, None  # JSON sent as protobuf
    yield good, {"content-type": "application/json"}, "body"  # protobuf sent as JSON
    yield good, {**as_proto, "content-encoding": "gzip"}, "Content-Encoding"


def test_malformed_bodies_are_named_4xx_and_leave_no_trace(
    live: LiveServer, http: httpx.Client, model: str
) -> None:
    valid = th.valid_bodies(http, model)
    posts = {p for m, p in th.face_routes(live.app) if m == "POST" and "{" not in p}
    untested = posts - {f"{th.PREFIX}{r}" for r in valid} - BODYLESS
    assert not untested, f"POST routes without malformed-body cases: {untested}"
    th.ok(http, "/forward_backward", th.fb_body(model))  # gradients pending: they must stay
    before = th.fingerprint(live, model), th.forward(http, model)
    records = th.records(live)
    checked = 0
    for route, data, headers, field in malformed_requests(valid):
        response = http.post(route, content=data, headers=headers)
        assert response.status_code < 500, (route, data[:200], response.text)
        th.check_refusal(response, field)
        checked += 1
    for data, headers, field in proto_requests(model):
        response = http.post("/forward_backward", content=data, headers=headers)
        th.check_refusal(response, field)
        checked += 1
    for route in ("/forward_backward", "/create_session", "/asample", "/optim_step"):
        response = http.post(route, content=b"[" + b"1," * BODY_MAX + b"1]")
        assert response.status_code == 413, (route, response.text)
        th.check_refusal(response)
    response = http.post("/create_model", json={**valid["/create_model"], "x": HUGE})
    assert response.status_code == 413, response.text
    assert checked > 120
    assert th.records(live) == records, "a refused request left a record"
    assert th.fingerprint(live, model) == before[0], "a refused request changed the model"
    assert th.forward(http, model) == before[1], "a refused request changed the logprobs"


def with_data(model: str, *token_lists: list[int]) -> dict[str, Any]:
    body = th.fb_body(model)
    body["forward_backward_input"]["data"] = [th.datum(tokens) for tokens in token_lists]
    return body


def test_limits_are_4xx_naming_the_tinker_field(
    live: LiveServer, http: httpx.Client, model: str
) -> None:
    """The model's limits (`LIMITS`), enforced by the engine's checks, refuse a request with
    the field's Tinker name (not the engine's `samples` / `model_inputs`), and no trace."""
    session = model.split(":")[0]
    prompt = {"chunks": [{"type": "encoded_text", "tokens": list(range(1, 40))}]}
    sample = {
        "base_model": th.BASE,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1]}]},
    }
    last_n = {
        **sample,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
        "sampling_params": {"max_tokens": 1},
        "prompt_logprobs": True,
    }
    cases = [
        # past the Tinker chunk cap (1,024 datums: above max_batch_size 4, `specs.chunk_datums`)
        ("/forward_backward", with_data(model, *[[1, 2]] * 1025), "forward_backward_input.data"),
        (
            "/forward_backward",
            with_data(model, list(range(1, 41))),
            "forward_backward_input.data[0].model_input",
        ),
        (
            "/forward_backward",
            with_data(model, *[list(range(1, 30))] * 4),
            "forward_backward_input.data",
        ),
        (
            "/create_model",
            {
                "session_id": session,
                "model_seq_id": 5,
                "base_model": th.BASE,
                "lora_config": {"rank": 9},
            },
            "lora_config.rank",
        ),
        (
            "/asample",
            {**sample, "sampling_params": {"max_tokens": 1000}},
            "sampling_params.max_tokens",
        ),
        ("/asample", {**sample, "prompt": prompt, "sampling_params": {"max_tokens": 4}}, "prompt"),
        ("/asample", {**sample, "num_samples": 10**4, "sampling_params": {}}, "num_samples"),
        *(
            (
                "/asample",
                {**last_n, "prompt_logprobs_last_n": n},
                "prompt_logprobs_last_n",
            )
            for n in (0, -1, 3, 2**40)  # N in [1, len(prompt) - 1] = [1, 2]
        ),
    ]
    before, records = th.fingerprint(live, model), th.records(live)
    for route, body, field in cases:
        response = http.post(route, json=body)
        assert response.status_code == 400, (route, field, response.text)
        error = response.json()["error"]
        assert error["param"] == field and error["message"].startswith(f"{field}: "), error
    # a token id past the vocabulary: refused at the door too, with no future
    response = http.post("/forward_backward", json=with_data(model, [1, 2, 500]))
    assert response.status_code == 400, response.text
    field = "forward_backward_input.data[0].loss_fn_inputs.target_tokens[1]"
    assert response.json()["error"]["param"] == field
    assert th.fingerprint(live, model) == before
    assert th.records(live) == records


# -- 5. futures ----------------------------------------------------------------------------


def test_a_running_request_answers_try_again_then_its_result(
    live: LiveServer, http: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_id = th.new_model(http)
    expected = th.forward(http, model_id)
    monkeypatch.setattr(routes, "LONG_POLL_S", 0.2)
    with COMPUTE_LOCK:  # the engine cannot run it yet
        request_id = http.post("/forward_backward", json=th.fb_body(model_id, True)).json()[
            "request_id"
        ]
        for _ in range(3):
            polled = http.post("/retrieve_future", json={"request_id": request_id}).json()
            assert polled == {
                "type": "try_again",
                "request_id": request_id,
                "queue_state": "active",
            }
    assert th.logprobs(th.wait(http, request_id)) == expected


def test_unknown_request_id_is_a_404_naming_it(http: httpx.Client) -> None:
    response = http.post("/retrieve_future", json={"request_id": "req_nope"})
    assert response.status_code == 404
    th.check_refusal(response, "request_id")


def test_retries_with_one_idempotency_key_run_once(live: LiveServer, http: httpx.Client) -> None:
    model_id = th.new_model(http)
    key = {"X-Idempotency-Key": "retry-1"}
    first = http.post("/forward_backward", json=th.fb_body(model_id), headers=key).json()
    again = http.post("/forward_backward", json=th.fb_body(model_id), headers=key).json()
    assert first["request_id"] == again["request_id"]
    # the same key on another route is another request
    optim = http.post("/optim_step", json=th.optim_body(model_id), headers=key).json()
    retry = http.post("/optim_step", json=th.optim_body(model_id), headers=key).json()
    assert optim["request_id"] == retry["request_id"] != first["request_id"]
    metrics = th.wait(http, optim["request_id"])["metrics"]
    assert th.engine_step(live, model_id) == 1
    # one forward-backward's gradient, not two: the norm of a single one (clipping off)
    reference = th.new_model(http)
    th.ok(http, "/forward_backward", th.fb_body(reference))
    single = th.ok(http, "/optim_step", th.optim_body(reference))["metrics"]
    # (Adam's first step hides a doubled gradient, so the norm is what tells one from two)
    assert metrics["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-4)
    np.testing.assert_allclose(th.forward(http, model_id), th.forward(http, reference), atol=1e-5)
    # another key is another step
    th.ok(http, "/optim_step", th.optim_body(model_id), **{"X-Idempotency-Key": "retry-2"})
    assert th.engine_step(live, model_id) == 2
    # retries racing each other (the SDK's retry after a timeout may overlap the first try)
    racing = {"X-Idempotency-Key": "retry-3"}

    def post(_: int) -> str:
        with th.client(live) as client:
            response = client.post("/optim_step", json=th.optim_body(model_id), headers=racing)
            assert response.status_code == 200, response.text
            request_id: str = response.json()["request_id"]
            return request_id

    with ThreadPoolExecutor(8) as pool:
        ids = set(pool.map(post, range(8)))
    assert len(ids) == 1, ids
    assert "error" not in th.wait(http, ids.pop())
    assert th.engine_step(live, model_id) == 3


def test_requests_without_a_key_or_seq_id_each_run(live: LiveServer, http: httpx.Client) -> None:
    """Two optim steps that carry neither an idempotency key nor a seq_id are two steps."""
    model_id = th.new_model(http)
    for _ in range(2):
        th.ok(http, "/forward_backward", th.fb_body(model_id))
        th.ok(http, "/optim_step", th.optim_body(model_id))
    assert th.engine_step(live, model_id) == 2


def test_futures_survive_a_restart_and_pending_ones_fail_cleanly(
    tiny_qwen_dir: Path, tmp_path: Path
) -> None:
    storage, models = tmp_path / "storage", {th.BASE: tiny_qwen_dir}
    held = threading.Event()
    release = threading.Event()

    def hold_the_engine() -> None:
        with COMPUTE_LOCK:
            held.set()
            release.wait(120)

    with serve_in_thread(storage, models, shutdown_grace_s=0.5) as first, th.client(first) as http:
        model_id = th.new_model(http)
        done = http.post("/forward_backward", json=th.fb_body(model_id, True)).json()
        result = th.wait(http, done["request_id"])
        holder = threading.Thread(target=hold_the_engine, daemon=True)
        holder.start()
        assert held.wait(30)
        running = http.post("/forward_backward", json=th.fb_body(model_id)).json()
        queued = http.post("/optim_step", json=th.optim_body(model_id)).json()
    try:
        with serve_in_thread(storage, models) as second, th.client(second, timeout=15) as http:
            assert th.wait(http, done["request_id"]) == result
            for pending in (running, queued):
                failed = th.wait(http, pending["request_id"], timeout=15)
                assert set(failed) == {"error", "category"}, failed
                assert failed["category"] in ("user", "server") and "restart" in failed["error"]
            response = http.post("/retrieve_future", json={"request_id": "req_unknown"})
            assert response.status_code == 404 and "request_id" in response.text
            assert http.post("/get_info", json={"model_id": model_id}).status_code == 200
            # the model's engine session did not survive: a new request on it is a 400 naming
            # model_id that says how to load it again
            response = http.post("/forward_backward", json=th.fb_body(model_id, True))
            th.check_refusal(response, "model_id")
            assert "no longer loaded" in response.text
    finally:
        release.set()
        holder.join(60)


def drive(http: httpx.Client, model_id: str, steps: int, at_once: bool) -> list[list[float]]:
    """`steps` rounds of forward, forward-backward and optim-step, then a forward: each call
    waited for in turn, or all submitted before any is waited for. The forwards' logprobs."""
    calls: list[tuple[str, dict[str, Any]]] = []
    for i in range(steps):
        calls.append(("/forward_backward", th.fb_body(model_id, True, seq_id=3 * i)))
        calls.append(("/forward_backward", th.fb_body(model_id, seq_id=3 * i + 1)))
        calls.append(("/optim_step", th.optim_body(model_id, seq_id=3 * i + 2)))
    calls.append(("/forward_backward", th.fb_body(model_id, True, seq_id=3 * steps)))
    results = []
    if at_once:
        ids = []
        for path, body in calls:
            response = http.post(path, json=body)
            assert response.status_code == 200, response.text
            ids.append(response.json()["request_id"])
        results = [th.wait(http, request_id) for request_id in ids]
    else:
        results = [th.ok(http, path, body) for path, body in calls]
    for result in results:
        assert "error" not in result, result
    forwards = [r for (_, body), r in zip(calls, results, strict=True) if body.get("forward_only")]
    return [th.logprobs(r) for r in forwards]


def test_concurrent_clients_and_queued_requests_complete_in_order(live: LiveServer) -> None:
    steps, clients = 3, 3

    def one_client(at_once: bool) -> tuple[str, list[list[float]]]:
        with th.client(live) as http:
            model_id = th.new_model(http)
            return model_id, drive(http, model_id, steps, at_once)

    with ThreadPoolExecutor(clients + 1) as pool:
        futures = [pool.submit(one_client, i == 0) for i in range(clients + 1)]
        runs = [f.result(timeout=600) for f in futures]
    first = np.array(runs[0][1])
    assert first.shape == (steps + 1, len(th.TOKENS) - 1)
    moved = np.abs(np.diff(first, axis=0)).max(axis=1)
    assert (moved > 1e-3).all(), f"each optim step moves the logprobs: {moved}"
    for model_id, forwards in runs:
        assert th.engine_step(live, model_id) == steps
        # the same calls in the same order give the same numbers (up to the float rounding of
        # operations batched with other sessions' on the shared base model), far below a step
        np.testing.assert_allclose(forwards, first, rtol=0, atol=1e-5)
