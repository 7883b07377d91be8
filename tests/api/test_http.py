"""Raw HTTP against the live worker: auth, signed URLs, idempotency, bad input, lifecycle."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from api_helpers import SEQUENCES, ce_sample, model_input, policy_sample
from conftest import LiveServer, wait_status

TERMINAL = ("TRAINING_OPERATION_STATUS_COMPLETED", "TRAINING_OPERATION_STATUS_FAILED")
CE = {"type": "LOSS_TYPE_CROSS_ENTROPY"}
KINDS = [
    "forward-backward",
    "custom-forward-backward",
    "optim-step",
    "weights-sync",
    "sample",
    "training-checkpoint",
    "inference-checkpoint",
]


def run_op(
    http: httpx.Client, sid: str, kind: str, body: dict[str, Any] | None = None, key: str = ""
) -> dict[str, Any]:
    url = f"/rl/training-sessions/{sid}/operations/{kind}"
    response = http.post(
        url, json=body or {}, headers={"Idempotency-Key": key or str(uuid.uuid4())}
    )
    assert response.status_code == 200, response.text
    op: dict[str, Any] = response.json()
    while op["status"] not in TERMINAL:
        time.sleep(0.05)
        op = http.get(f"{url}/{op['id']}").json()
    return op


def output(http: httpx.Client, sid: str, kind: str, body: dict[str, Any] | None = None) -> Any:
    op = run_op(http, sid, kind, body)
    assert op["status"] == TERMINAL[0], op
    return op["output"]


def new_resource(http: httpx.Client, base_model: str = "tiny-qwen", **extra: Any) -> str:
    response = http.post("/rl/model-resources", json={"base_model": base_model, **extra})
    assert response.status_code == 200, response.text
    rid: str = response.json()["id"]
    wait_status(http, f"/rl/model-resources/{rid}", "MODEL_RESOURCES_STATUS_READY")
    return rid


def new_session(http: httpx.Client, rid: str, **extra: Any) -> str:
    body = {"model_resources_id": rid, "lora_config": {"rank": 4, "seed": 0}, **extra}
    response = http.post("/rl/training-sessions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["status"] == "TRAINING_SESSION_STATUS_RUNNING"
    sid: str = response.json()["id"]
    return sid


def logprobs(http: httpx.Client, sid: str) -> list[list[float]]:
    body = {"loss": CE, "samples": [ce_sample(s) for s in SEQUENCES], "forward_only": True}
    out = output(http, sid, "forward-backward", {**body, "return_loss_fn_outputs": True})
    return [o["tensors"]["logprobs"]["data"] for o in out["loss_fn_outputs"]]


@pytest.fixture(scope="module")
def http(server: LiveServer) -> Iterator[httpx.Client]:
    with server.client() as client:
        yield client


@pytest.fixture(scope="module")
def session(http: httpx.Client) -> tuple[str, str]:
    rid = new_resource(http)
    return rid, new_session(http, rid)


def test_every_route_needs_the_token(server: LiveServer) -> None:
    routes = [
        (method.upper(), path)
        for path, methods in server.app.openapi()["paths"].items()
        if path.startswith("/v1/rl/")
        and "/files/" not in path
        and not path.startswith("/v1/rl/payloads/")
        for method in methods
    ]
    expanded = [
        (method, path.replace("{kind}", kind))
        for method, path in routes
        for kind in (KINDS if "{kind}" in path else ["-"])
    ]
    assert len(expanded) == 29 + 2  # the contract's 29 endpoints and the 2 payload-URL ones
    for token in (None, "wrong-token"):
        with server.client(token) as client:
            for method, path in expanded:
                url = path.replace("{", "").replace("}", "")[len("/v1") :]
                response = client.request(method, url, json={})
                assert response.status_code == 401, (method, path, response.text)
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}
                assert error["type"] == "authentication_error"
    with server.client(None) as client:
        assert httpx.get(f"{server.url}/healthz").json() == {"status": "ok"}
        assert client.get("/v1/rl/supported-models").status_code == 401  # /v1/v1/... too


def test_signed_urls(server: LiveServer, http: httpx.Client, session: tuple[str, str]) -> None:
    _, sid = session
    checkpoint = output(http, sid, "inference-checkpoint")["checkpoint"]["id"]
    files = http.get(
        f"/rl/checkpoints/{checkpoint}/download", params={"variant": "CHECKPOINT_VARIANT_ADAPTER"}
    ).json()["data"]
    names = {f["filename"] for f in files}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= names
    entry = next(f for f in files if f["filename"] == "adapter_config.json")
    good = httpx.get(entry["url"])  # no Authorization header, as the SDK fetches it
    assert good.status_code == 200 and len(good.content) == int(entry["size"])
    url = httpx.URL(entry["url"])
    sig = url.params["sig"]
    tampered = [
        url.copy_set_param("sig", ("0" if sig[0] != "0" else "1") + sig[1:]),
        url.copy_set_param("expires", str(int(url.params["expires"]) + 10)),
        url.copy_with(path=url.path.replace("adapter_config.json", "adapter_model.safetensors")),
        url.copy_remove_param("sig"),
    ]
    for bad in tampered:
        response = httpx.get(bad)
        assert response.status_code == 403, bad
        assert response.json()["error"]["code"] == "invalid_signature"
    expired = server.app.state.signer.sign(server.url, "GET", url.path, now=time.time() - 7200)
    assert httpx.get(expired).status_code == 403

    upload = http.post(f"/rl/training-sessions/{sid}/payloads/upload-url").json()
    put_url = httpx.URL(upload["upload_url"])
    assert httpx.put(put_url, content=b'{"a": 1}').status_code == 200
    assert httpx.get(put_url).status_code == 403  # signed for PUT only
    bad_put = put_url.copy_set_param("sig", "f" * 64)
    assert httpx.put(bad_put, content=b"{}").status_code == 403
    pid = upload["payload_id"]
    down = http.post(f"/rl/training-sessions/{sid}/payloads/{pid}/download-url").json()
    assert httpx.get(down["download_url"]).json() == {"a": 1}
    missing = http.post(f"/rl/training-sessions/{sid}/payloads/pl_{'0' * 32}/download-url")
    assert missing.status_code == 404


def test_idempotency(http: httpx.Client, session: tuple[str, str]) -> None:
    _, sid = session
    url = f"/rl/training-sessions/{sid}/operations/optim-step"
    missing = http.post(url, json={})
    assert missing.status_code == 400
    assert missing.json()["error"]["code"] == "missing_idempotency_key"
    assert missing.json()["error"]["param"] == "Idempotency-Key"

    step_before = http.get(f"/rl/training-sessions/{sid}").json()["step"]
    key = str(uuid.uuid4())
    body = {"adam_params": {"learning_rate": 1e-3}}
    first = run_op(http, sid, "optim-step", body, key=key)
    again = http.post(url, json=body, headers={"Idempotency-Key": key})
    assert again.status_code == 200 and again.json() == first
    assert http.get(f"/rl/training-sessions/{sid}").json()["step"] == step_before + 1

    other = http.post(
        url, json={"adam_params": {"learning_rate": 1e-2}}, headers={"Idempotency-Key": key}
    )
    assert other.status_code == 409 and other.headers["x-should-retry"] == "false"
    assert other.json()["error"]["code"] == "idempotency_key_reused"
    other_kind = http.post(
        f"/rl/training-sessions/{sid}/operations/weights-sync",
        json={"weight_sync_type": "WEIGHT_SYNC_TYPE_SYNCHRONOUS"},
        headers={"Idempotency-Key": key},
    )
    assert other_kind.status_code == 409
    assert http.get(f"/rl/training-sessions/{sid}").json()["step"] == step_before + 1


def _fb(samples: list[Any], loss: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    return {"loss": loss or CE, "samples": samples, **extra}


GOOD = ce_sample(SEQUENCES[0])
N = len(SEQUENCES[0]) - 1


def _with_inputs(**inputs: Any) -> dict[str, Any]:
    sample = json.loads(json.dumps(GOOD))
    for name, value in inputs.items():
        if value is None:
            sample["loss_fn_inputs"].pop(name)
        else:
            sample["loss_fn_inputs"][name] = value
    return sample


MALFORMED: list[tuple[str, dict[str, Any] | str, str]] = [
    ("forward-backward", {"samples": [GOOD]}, "loss"),
    ("forward-backward", _fb([GOOD], {"type": "LOSS_TYPE_NOPE"}), "loss.type"),
    ("forward-backward", _fb([]), "samples"),
    (
        "forward-backward",
        _fb([_with_inputs(target_tokens=None)]),
        "samples[0].loss_fn_inputs.target_tokens",
    ),
    (
        "forward-backward",
        _fb([_with_inputs(weights={"data": [1.0], "dtype": "float32"})]),
        "samples[0].loss_fn_inputs.weights",
    ),
    (
        "forward-backward",
        _fb([_with_inputs(weights={"data": [1.0] * N, "dtype": "float64"})]),
        "samples[0].loss_fn_inputs.weights.dtype",
    ),
    (
        "forward-backward",
        json.dumps(_fb([ce_sample([1, 2, 3], [1.0, 12345.5])])).replace("12345.5", "NaN"),
        "samples[0].loss_fn_inputs.weights",
    ),
    (
        "forward-backward",
        _fb([{**GOOD, "model_input": model_input(["abc"])}]),
        "samples[0].model_input",
    ),  # type: ignore[list-item]
    ("forward-backward", _fb([GOOD], {"type": "LOSS_TYPE_DRO"}), "loss"),
    (  # its sampler logprobs come from the Tinker face's records (docs/semantics.md §13)
        "forward-backward",
        _fb(
            [policy_sample(SEQUENCES[0], [-1.0] * N, [1.0] * N)],
            {"type": "LOSS_TYPE_STABLE_REINFORCE"},
        ),
        "loss.type",
    ),
    (
        "forward-backward",
        _fb([policy_sample(SEQUENCES[0], [-1.0] * N, [1.0] * N)], {"type": "stable_reinforce"}),
        "loss.type",
    ),
    (
        "forward-backward",
        _fb(
            [policy_sample(SEQUENCES[0], [-1.0] * N, [1.0] * N)],
            {"type": "LOSS_TYPE_GRPO", "grpo_params": {"beta": 0.1}},
        ),
        "samples[0].loss_fn_inputs.reference_logprobs",
    ),
    (
        "forward-backward",
        _fb([_with_inputs(mask={"data": [1] * N, "dtype": "int64"})]),
        "samples[0].loss_fn_inputs",
    ),
    ("forward-backward", _fb([GOOD], forward_only="perhaps"), "forward_only"),
    ("forward-backward", "{not json", ""),
    ("forward-backward", "[1, 2]", ""),
    (
        "forward-backward",
        _fb([GOOD], {"type": "LOSS_TYPE_PPO", "ppo_params": {"clip_low_threshold": 2.0}}),
        "loss",
    ),
    ("custom-forward-backward", {"samples": [GOOD], "gradients": [{"data": [1.0]}]}, "gradients"),
    ("optim-step", {"adam_params": {"learning_rate": -1}}, "adam_params.learning_rate"),
    ("optim-step", {"adam_params": {"beta1": 1.5}}, "adam_params.beta1"),
    ("optim-step", {"muon_params": {"learning_rate": 0.1}}, "muon_params"),
    ("weights-sync", {}, "weight_sync_type"),
    ("weights-sync", {"weight_sync_type": "WEIGHT_SYNC_TYPE_SOMETIMES"}, "weight_sync_type"),
    (
        "sample",
        {"model_inputs": [model_input([1, 2])], "topk_prompt_logprobs": 50},
        "topk_prompt_logprobs",
    ),
    ("sample", {"model_inputs": [model_input([1, 2])], "num_samples": 0}, "num_samples"),
    ("sample", {"model_inputs": []}, "model_inputs"),
    (
        "sample",
        {"model_inputs": [model_input([1, 2])], "sampling_params": {"max_tokens": 0}},
        "sampling_params.max_tokens",
    ),
]


def test_malformed_bodies_are_4xx_naming_the_field(
    http: httpx.Client, session: tuple[str, str]
) -> None:
    _, sid = session
    before_step = http.get(f"/rl/training-sessions/{sid}").json()["step"]
    before = logprobs(http, sid)
    for kind, body, field in MALFORMED:
        url = f"/rl/training-sessions/{sid}/operations/{kind}"
        headers = {"Idempotency-Key": str(uuid.uuid4()), "Content-Type": "application/json"}
        content = body if isinstance(body, str) else json.dumps(body)
        response = http.post(url, content=content, headers=headers)
        assert response.status_code == 400, (kind, body, response.text)
        error = response.json()["error"]
        assert error["message"]
        if field:
            assert (error["param"] or "").startswith(field), (field, error)
            assert field.split(".")[0] in error["message"]
    # A token id past the vocabulary of the loaded model is refused at the door too.
    url = f"/rl/training-sessions/{sid}/operations/forward-backward"
    out_of_vocab = http.post(
        url, json=_fb([ce_sample([1, 2, 100000])]), headers={"Idempotency-Key": str(uuid.uuid4())}
    )
    assert out_of_vocab.status_code == 400, out_of_vocab.text
    assert out_of_vocab.json()["error"]["param"] == "samples[0].loss_fn_inputs.target_tokens[1]"
    # Nothing above touched the session: same step, same weights, no stray gradients.
    assert http.get(f"/rl/training-sessions/{sid}").json()["step"] == before_step
    assert logprobs(http, sid) == before
    out = output(http, sid, "optim-step", {})
    assert out["metrics"]["grad_norm"] == 0.0


def test_bad_resource_and_session_requests(http: httpx.Client, session: tuple[str, str]) -> None:
    rid, _ = session
    cases = [
        ("/rl/model-resources", {"base_model": "nope"}, 400, "base_model"),
        (
            "/rl/model-resources",
            {"base_model": "tiny-qwen", "inactive_timeout": 10},
            400,
            "inactive_timeout",
        ),
        (
            "/rl/model-resources",
            {"base_model": "tiny-qwen", "optimizer_config": {"muon": {"scaling_strategy": "X"}}},
            400,
            "optimizer_config",
        ),
        ("/rl/model-resources/estimate-cost", {}, 400, "base_model"),
        ("/rl/training-sessions", {"model_resources_id": "mr_nope"}, 404, "model_resources_id"),
        (
            "/rl/training-sessions",
            {"model_resources_id": rid, "lora_config": {"rank": 1000}},
            400,
            "lora_config.rank",
        ),
        (
            "/rl/training-sessions",
            {"model_resources_id": rid, "resume_from_checkpoint_id": "ckpt-nope"},
            404,
            "resume_from_checkpoint_id",
        ),
        (
            "/rl/training-sessions",
            {"model_resources_id": rid, "display_name": "x" * 200},
            400,
            "display_name",
        ),
        (f"/rl/model-resources/{rid}/extend-expiry", {"seconds": 5}, 400, "seconds"),
    ]
    for url, body, status, param in cases:
        response = http.post(url, json=body)
        assert response.status_code == status, (url, body, response.text)
        assert (response.json()["error"]["param"] or "").startswith(param), response.json()
    for url in ("/rl/model-resources/mr_x", "/rl/training-sessions/ts_x", "/rl/checkpoints/ckpt-x"):
        assert http.get(url).status_code == 404
    assert http.get("/rl/model-resources", params={"limit": 0}).status_code == 400
    assert http.get("/rl/training-sessions", params={"limit": "abc"}).status_code == 400
    assert http.get("/rl/model-resources", params={"status": "NOPE"}).status_code == 400
    estimate = http.post("/rl/model-resources/estimate-cost", json={"base_model": "tiny-qwen"})
    assert estimate.json() == {"currency": "USD", "price_per_hour": 0.0}
    models = {m["base_model"]: m for m in http.get("/rl/supported-models").json()["data"]}
    assert set(models) == {"tiny-qwen", "tiny-llama", "broken"}
    lora = models["tiny-qwen"]["compute_configs"][0]["trainer_config"]["lora"]
    assert lora["max_rank"] == 128 and lora["max_seq_length"] == 512  # max_position_embeddings


def test_session_lifecycle_lists_and_patch(http: httpx.Client) -> None:
    rid = new_resource(http, "tiny-llama", inactive_timeout=300)
    sids = [new_session(http, rid, display_name=f"s{i}") for i in range(3)]
    page = http.get("/rl/training-sessions", params={"model_resources_id": rid, "limit": 2}).json()
    assert [s["id"] for s in page["data"]] == sids[:2] and page["meta"]["has_more"]
    rest = http.get(
        "/rl/training-sessions",
        params={"model_resources_id": rid, "after": page["meta"]["next_cursor"]},
    ).json()
    assert [s["id"] for s in rest["data"]] == sids[2:] and not rest["meta"]["has_more"]

    patched = http.patch(
        f"/rl/training-sessions/{sids[0]}",
        json={"display_name": "renamed", "metadata": {"wandb": {"project": "p", "run_id": "r"}}},
    ).json()
    assert patched["display_name"] == "renamed"
    assert patched["metadata"] == {"wandb": {"project": "p", "run_id": "r"}}
    cleared = http.patch(
        f"/rl/training-sessions/{sids[0]}",
        json={"display_name": "", "metadata": {"wandb": {"project": ""}}},
    ).json()
    assert "display_name" not in cleared and cleared["metadata"] == {"wandb": {"run_id": "r"}}

    stopped = http.post(f"/rl/training-sessions/{sids[1]}/stop").json()
    assert stopped["status"] == "TRAINING_SESSION_STATUS_STOPPED"
    filtered = http.get(
        "/rl/training-sessions",
        params={
            "model_resources_id": rid,
            "status": "TRAINING_SESSION_STATUS_STOPPED,TRAINING_SESSION_STATUS_ERROR",
        },
    ).json()
    assert [s["id"] for s in filtered["data"]] == [sids[1]]
    late = run_op(http, sids[1], "optim-step")
    assert late["error"]["code"] == "TRAINING_OPERATION_ERROR_CODE_SESSION_NOT_ACTIVE"

    before = http.get(f"/rl/model-resources/{rid}").json()["expires_at"]
    extended = http.post(f"/rl/model-resources/{rid}/extend-expiry", json={"seconds": 7200}).json()
    assert extended["expires_at"] > before
    refused = http.post(f"/rl/model-resources/{rid}/stop")
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "force"
    done = http.post(f"/rl/model-resources/{rid}/stop", params={"force": "true"}).json()
    assert done["status"] == "MODEL_RESOURCES_STATUS_STOPPED"
    for sid in sids:
        assert (
            http.get(f"/rl/training-sessions/{sid}").json()["status"]
            == "TRAINING_SESSION_STATUS_STOPPED"
        )
    again = http.post(f"/rl/model-resources/{rid}/stop")
    assert again.status_code == 200  # stopping a stopped resource is a no-op
    late_session = http.post("/rl/training-sessions", json={"model_resources_id": rid})
    assert late_session.status_code == 400
    assert late_session.json()["error"]["param"] == "model_resources_id"
    assert (
        http.post(f"/rl/model-resources/{rid}/extend-expiry", json={"seconds": 600}).status_code
        == 400
    )
    listed = http.get(
        "/rl/model-resources", params={"status": "MODEL_RESOURCES_STATUS_STOPPED"}
    ).json()
    assert rid in [r["id"] for r in listed["data"]]


def test_operations_run_in_order_and_poll(http: httpx.Client, session: tuple[str, str]) -> None:
    _, sid = session
    base = http.get(f"/rl/training-sessions/{sid}").json()["step"]
    url = f"/rl/training-sessions/{sid}/operations/optim-step"
    ops = [
        http.post(url, json={}, headers={"Idempotency-Key": str(uuid.uuid4())}).json()
        for _ in range(4)
    ]
    steps = []
    for op in ops:
        while op["status"] not in TERMINAL:
            time.sleep(0.05)
            op = http.get(f"{url}/{op['id']}").json()
        steps.append(int(op["output"]["step"]))
    assert steps == [base + 1, base + 2, base + 3, base + 4]
    assert http.get(f"{url.replace('optim-step', 'sample')}/{ops[0]['id']}").status_code == 404
    assert http.get(f"{url}/op_missing").status_code == 404
    state = http.get(f"/rl/training-sessions/{sid}").json()["policy_state"]
    assert state["trainer_step"] == base + 4 and state["pending_publish"] is False
    sync = output(
        http, sid, "weights-sync", {"weight_sync_type": "WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH"}
    )
    assert sync["weights_version"] == base + 4
    state = http.get(f"/rl/training-sessions/{sid}").json()["policy_state"]
    assert state["target_weights_version"] == base + 4 and state["pending_publish"] is True
    result = output(
        http,
        sid,
        "sample",
        {"model_inputs": [model_input([1, 2])], "sampling_params": {"max_tokens": 2}},
    )
    assert result["results"][0]["policy_segments"] == [{"start_token": 0, "version": base + 4}]
    state = http.get(f"/rl/training-sessions/{sid}").json()["policy_state"]
    assert state["applied_weights_version"] == base + 4 and state["pending_publish"] is False


def test_inactive_resource_expires(server: LiveServer, http: httpx.Client) -> None:
    rid = new_resource(http, "tiny-llama", lora_enabled=True, inactive_timeout=300)
    sid = new_session(http, rid)
    live = server.worker.resources.get_live(rid)
    assert live is not None
    live.expires_at = time.time() - 1  # as if 300 s had passed with no activity
    wait_status(http, f"/rl/model-resources/{rid}", "MODEL_RESOURCES_STATUS_STOPPED", timeout=10)
    assert (
        http.get(f"/rl/training-sessions/{sid}").json()["status"]
        == "TRAINING_SESSION_STATUS_EXPIRED"
    )


def test_failed_load_is_error_and_large_bodies_are_413(
    http: httpx.Client, session: tuple[str, str]
) -> None:
    rid = http.post("/rl/model-resources", json={"base_model": "broken"}).json()["id"]
    failed = wait_status(http, f"/rl/model-resources/{rid}", "MODEL_RESOURCES_STATUS_ERROR")
    assert failed["error"]["code"] == "MODEL_RESOURCES_ERROR_CODE_PROVISIONING_FAILED"
    assert "/nonexistent/model" in failed["error"]["message"]
    assert http.post(f"/rl/model-resources/{rid}/stop").json()["status"] == (
        "MODEL_RESOURCES_STATUS_ERROR"
    )
    _, sid = session
    big = {"loss": CE, "samples": [ce_sample([1, 2] * 100_000)]}
    response = http.post(
        f"/rl/training-sessions/{sid}/operations/forward-backward",
        json=big,
        headers={"Idempotency-Key": str(uuid.uuid4())},
    )
    assert response.status_code == 413
    assert "upload-url" in response.json()["error"]["message"]
