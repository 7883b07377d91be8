"""Hostile input that is not random: limits, path-escaping ids, the schema's exposure, secrets.

- every catalogue limit is a 4xx naming the field, and refused calls change nothing;
- an id on any route (`../`, encoded, over-long, NUL) never reaches a file path outside the
  storage directory: 400 naming the parameter, or 404, never 2xx or 5xx;
- `/openapi.json` and `/docs` are not open; the schema is served behind the token;
- with DEBUG logging, the bearer token never appears in the worker's output.
"""

from __future__ import annotations

import re
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.conftest import TOKEN as THREAD_TOKEN
from tests.api.conftest import serve_in_thread
from tests.faults.procs import (
    CE,
    TOKEN,
    ce_sample,
    forked_worker,
    forward_logprobs,
    model_input,
    new_resource,
    new_session,
    output,
    run_op,
    terminate,
)

LIMITS = {"max_seq_length": 64, "max_batch_size": 4, "max_tokens_per_call": 100}


@pytest.fixture(scope="module")
def limited(tiny_qwen_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    model = [{"name": "tiny-qwen", "location": str(tiny_qwen_dir), **LIMITS}]
    storage = tmp_path_factory.mktemp("hostile") / "storage"
    with (
        serve_in_thread(storage, {}, model=model, max_body_bytes=16384) as live,
        live.client() as http,
    ):
        rid = new_resource(http, "tiny-qwen")
        sid = new_session(http, rid, lora_config={"rank": 4, "seed": 0})
        yield live, http, rid, sid


def _seq(n: int, start: int = 2) -> list[int]:
    return [start + (i % 100) for i in range(n)]


def _sample_body(prompts: int, n: int, max_tokens: int, prompt_len: int = 4) -> dict[str, Any]:
    return {
        "model_inputs": [model_input(_seq(prompt_len)) for _ in range(prompts)],
        "num_samples": n,
        "sampling_params": {"max_tokens": max_tokens},
    }


LIMIT_CASES: list[tuple[str, str, dict[str, Any], str, str]] = [
    # (limit, kind, body, param, text in the message)
    (
        "samples per call",
        "forward-backward",
        {"loss": CE, "samples": [ce_sample(_seq(5)) for _ in range(5)]},
        "samples",
        "max_batch_size",
    ),
    (
        "tokens per sample",
        "forward-backward",
        {"loss": CE, "samples": [ce_sample(_seq(66))]},
        "samples[0].model_input",
        "max_seq_length",
    ),
    (
        "tokens per call",
        "forward-backward",
        {"loss": CE, "samples": [ce_sample(_seq(31)) for _ in range(4)]},
        "samples",
        "max_tokens_per_call",
    ),
    (
        "tokens per call (custom)",
        "custom-forward-backward",
        {
            "samples": [ce_sample(_seq(31)) for _ in range(4)],
            "gradients": [{"data": [0.1] * 30} for _ in range(4)],
        },
        "samples",
        "max_tokens_per_call",
    ),
    ("sample count", "sample", _sample_body(1, 5, 4), "num_samples", "max_batch_size"),
    ("sequences", "sample", _sample_body(2, 3, 4), "num_samples", "max_batch_size"),
    ("prompts", "sample", _sample_body(5, 1, 4), "model_inputs", "max_batch_size"),
    (
        "max_tokens",
        "sample",
        _sample_body(1, 1, 64),
        "sampling_params.max_tokens",
        "context length",
    ),
    (
        "prompt + max_tokens",
        "sample",
        _sample_body(1, 1, 40, prompt_len=30),
        "model_inputs[0]",
        "context length",
    ),
    (
        "generated tokens per call",
        "sample",
        _sample_body(1, 4, 30),
        "sampling_params.max_tokens",
        "max_tokens_per_call",
    ),
]


def test_limits_are_4xx_naming_the_field(limited: Any) -> None:
    _, http, _, sid = limited
    output(http, sid, "forward-backward", {"loss": CE, "samples": [ce_sample(_seq(9))]})
    before = http.get(f"/rl/training-sessions/{sid}").json()
    logprobs = forward_logprobs(http, sid, [_seq(9)])
    for limit, kind, body, param, text in LIMIT_CASES:
        response = http.post(
            f"/rl/training-sessions/{sid}/operations/{kind}",
            json=body,
            headers={"Idempotency-Key": str(uuid.uuid4())},
        )
        assert response.status_code == 400, (limit, response.text)
        error = response.json()["error"]
        assert error["param"] == param, (limit, error)
        assert text in error["message"] and param.split("[")[0] in error["message"], error
    too_big = {"loss": CE, "samples": [ce_sample(_seq(60))] * 40}  # > max_body_bytes
    response = http.post(
        f"/rl/training-sessions/{sid}/operations/forward-backward",
        json=too_big,
        headers={"Idempotency-Key": str(uuid.uuid4())},
    )
    assert response.status_code == 413 and "upload-url" in response.json()["error"]["message"]
    after = http.get(f"/rl/training-sessions/{sid}").json()
    assert after["step"] == before["step"] and after["policy_state"] == before["policy_state"]
    assert forward_logprobs(http, sid, [_seq(9)]) == logprobs
    step = output(http, sid, "optim-step", {})  # the gradient from before the refusals only
    assert step["step"] == before["step"] + 1


HOSTILE = [
    "..",
    "%2E%2E",
    ".hidden",
    "..%2F..%2Fsecret",
    "a%2F..%2F..%2Fsecret",
    "..%5C..%5Csecret",
    "a%00b",
    "ckpt-" + "0" * 300,
    "%2E%2E%2F%2E%2E%2Fsecret.json",
]


def test_ids_never_leave_the_storage_directory(limited: Any, tmp_path: Path) -> None:
    live, _, _, sid = limited
    outside = live.storage.parent / "secret.json"
    outside.write_text('{"sentinel": "7f3a-outside-storage"}')
    before = sorted(p.as_posix() for p in live.storage.parent.rglob("*"))
    templates = [
        (method.upper(), path)
        for path, methods in live.app.openapi()["paths"].items()
        if "{" in path
        for method in methods
    ]
    templates += [
        ("GET", "/v1/rl/files/checkpoints/{checkpoint_id}/{variant}/{filename}"),
        ("GET", "/v1/rl/payloads/{session_id}/{payload_id}"),
        ("PUT", "/v1/rl/payloads/{session_id}/{payload_id}"),
    ]
    assert len(templates) >= 20
    headers = {"Authorization": f"Bearer {THREAD_TOKEN}", "Idempotency-Key": "k"}
    with httpx.Client(base_url=live.url, headers=headers, timeout=60) as raw:
        for method, template in templates:
            names = re.findall(r"{(\w+)}", template)
            for name in names:
                for bad in HOSTILE:
                    path = template
                    for other in names:
                        path = path.replace(f"{{{other}}}", bad if other == name else sid)
                    response = raw.request(method, path, content=b"{}")
                    sent = response.request.url.raw_path.decode().split("?")[0]
                    if sent != path:
                        # the client resolved a literal `..` segment itself: another route
                        # (`/api/v1/training_runs/../checkpoints` is `/api/v1/checkpoints`),
                        # whose answer is that route's own
                        assert "7f3a-outside-storage" not in response.text
                        continue
                    assert response.status_code in (400, 403, 404, 405), (path, response.text)
                    if response.status_code == 400:
                        assert response.json()["error"]["param"] in names, response.text
                    assert "7f3a-outside-storage" not in response.text
    after = sorted(p.as_posix() for p in live.storage.parent.rglob("*"))
    assert after == before, "nothing created or removed outside the worker's own files"
    assert outside.read_text() == '{"sentinel": "7f3a-outside-storage"}'


def test_resume_reads_no_directory_outside_storage(limited: Any, tmp_path: Path) -> None:
    live, http, rid, sid = limited
    outside = tmp_path / "adapter"
    outside.mkdir()
    hostile = [str(outside), "/etc", "../../..", "~", "./", str(live.storage / ".." / "..")]
    for location in hostile:
        response = http.post(
            "/rl/training-sessions",
            json={"model_resources_id": rid, "resume_from_hf_checkpoint": location},
        )
        assert response.status_code == 400, (location, response.text)
        assert response.json()["error"]["param"] == "resume_from_hf_checkpoint"
    # the storage's own checkpoints are named by id, never by their directory
    ckpt = output(http, sid, "inference-checkpoint")["checkpoint"]["id"]
    inside = live.storage / "checkpoints" / ckpt / "adapter"
    refused = http.post(
        "/rl/training-sessions",
        json={"model_resources_id": rid, "resume_from_hf_checkpoint": str(inside)},
    )
    assert refused.status_code == 400, refused.text
    assert "resume_from_checkpoint_id" in refused.json()["error"]["message"]
    resumed = new_session(http, rid, resume_from_checkpoint_id=ckpt)
    assert http.post(f"/rl/training-sessions/{resumed}/stop").status_code == 200


def test_schema_and_docs_are_not_open(limited: Any) -> None:
    live, http, _, _ = limited
    for path in ("/openapi.json", "/docs", "/redoc", "/docs/oauth2-redirect"):
        assert httpx.get(f"{live.url}{path}").status_code == 404, path
    assert httpx.get(f"{live.url}/v1/openapi.json").status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert httpx.get(f"{live.url}/v1/openapi.json", headers=wrong).status_code == 401
    schema = http.get("/openapi.json").json()
    fb = schema["paths"]["/v1/rl/training-sessions/{session_id}/operations/forward-backward"]
    body = fb["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {"loss", "samples"} <= set(body["properties"]) and "$ref" not in str(body)
    assert any(p["name"] == "Idempotency-Key" for p in fb["post"]["parameters"])


def test_token_never_in_debug_logs(tiny_qwen_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "debug.log"
    storage = tmp_path / "storage"
    models = {"tiny-qwen": tiny_qwen_dir}
    with forked_worker(storage, models, log, "--log-level", "debug") as worker:
        with worker.client() as http:
            sid = new_session(http, new_resource(http, "tiny-qwen"), lora_config={"rank": 4})
            output(http, sid, "forward-backward", {"loss": CE, "samples": [ce_sample(_seq(9))]})
            ckpt = output(http, sid, "inference-checkpoint")["checkpoint"]["id"]
            files = http.get(
                f"/rl/checkpoints/{ckpt}/download",
                params={"variant": "CHECKPOINT_VARIANT_ADAPTER"},
            ).json()["data"]
            assert httpx.get(files[0]["url"]).status_code == 200
            for token in (TOKEN[:-1], TOKEN + "x", "x"):
                bad = {"Authorization": f"Bearer {token}"}
                assert httpx.get(f"{worker.url}/v1/rl/checkpoints", headers=bad).status_code == 401
        code, _ = terminate(worker)
    assert code == 0
    text = log.read_text(errors="replace")
    assert "DEBUG" in text and "/v1/rl/checkpoints" in text, "DEBUG logging was on"
    assert TOKEN not in text and TOKEN[:-1] not in text
    assert "sig=<redacted>" in text and not re.search(r"sig=[0-9a-f]{16}", text)


def test_a_nan_neighbour_fails_only_its_own_samples(tiny_qwen_dir: Path, tmp_path: Path) -> None:
    """Over HTTP with the defaults (samples of one resource's sessions batched): an absurd
    learning rate is a 400 naming it; a session whose published adapter is NaN fails its
    samples with NON_FINITE_LOSS while four neighbours sampling at the same time get the
    tokens they get alone."""
    with (
        serve_in_thread(tmp_path / "storage", {"tiny-qwen": tiny_qwen_dir}) as live,
        live.client() as http,
    ):
        rid = new_resource(http, "tiny-qwen")
        sids = [new_session(http, rid, lora_config={"rank": 4, "seed": i}) for i in range(5)]
        for sid in sids:
            output(http, sid, "forward-backward", {"loss": CE, "samples": [ce_sample(_seq(9))]})
            output(http, sid, "optim-step", {"adam_params": {"learning_rate": 1e-2}})
            output(http, sid, "weights-sync", {"weight_sync_type": "WEIGHT_SYNC_TYPE_SYNCHRONOUS"})
        hostile, neighbours = sids[0], sids[1:]
        response = http.post(
            f"/rl/training-sessions/{hostile}/operations/optim-step",
            json={"adam_params": {"learning_rate": 1e30}},
            headers={"Idempotency-Key": str(uuid.uuid4())},
        )
        assert response.status_code == 400 and "learning_rate" in response.text, response.text

        def body(i: int) -> dict[str, Any]:
            sample = _sample_body(2, 2, 12)
            sample["sampling_params"]["seed"] = 40 + i
            return sample

        alone = {sid: output(http, sid, "sample", body(i)) for i, sid in enumerate(sids)}
        engine = live.worker.sessions[hostile].engine
        for tensor in engine.policy.published_tensors().values():
            tensor.detach().fill_(float("nan"))
        with ThreadPoolExecutor(len(sids)) as pool:
            ops = dict(zip(sids, pool.map(_sample_op, [live] * 5, sids, map(body, range(5)))))
        assert ops[hostile]["status"] == "TRAINING_OPERATION_STATUS_FAILED", ops[hostile]
        error = ops[hostile]["error"]
        assert error["code"] == "TRAINING_OPERATION_ERROR_CODE_NON_FINITE_LOSS", error
        assert "weights" in error["message"]
        for sid in neighbours:
            assert ops[sid]["status"] == "TRAINING_OPERATION_STATUS_COMPLETED", ops[sid]
            got = [[s["tokens"] for s in r["sequences"]] for r in ops[sid]["output"]["results"]]
            want = [[s["tokens"] for s in r["sequences"]] for r in alone[sid]["results"]]
            assert got == want


def _sample_op(live: Any, sid: str, body: dict[str, Any]) -> dict[str, Any]:
    with live.client() as http:  # a client of its own, as separate tenants have
        return run_op(http, sid, "sample", body)
