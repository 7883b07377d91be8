"""Fuzz the HTTP API from its own OpenAPI schema (schemathesis), against the real worker.

The schema comes from the app in-process (`app.openapi()`; it is not served openly), and
describes the real request bodies (`trainer.api.openapi`), so generated bodies reach the
validators and the engine, not just the JSON parser. Path ids are pinned to a live session and
resource for most cases (random ids only find 404s), positive and negative (schema-violating)
cases are mixed, and after every request:

- no response is >= 500;
- every refusal (4xx) has the error body with a `param` naming the field, and the message
  names it too (or says which part of the request: body, path, method);
- a refusal, or an operation that FAILs, leaves the session's weights, gradients and step
  exactly as they were (compared bit for bit in-process).

`TRAINER_FUZZ_EXAMPLES` sets the number of generated requests (default 600).
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

import pytest
import requests
import schemathesis
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.generation.modes import GenerationMode

from tests.api.conftest import TOKEN, LiveServer, serve_in_thread
from tests.faults.procs import new_resource, new_session
from trainer.api.store import OP_COMPLETED, OP_FAILED, OperationRow

EXAMPLES = int(os.environ.get("TRAINER_FUZZ_EXAMPLES", "600"))
LIMITS = {"max_seq_length": 32, "max_batch_size": 4, "max_tokens_per_call": 96}
# Routes where a pinned id would end the session under test: they get generated ids only.
UNPINNED = ("/stop",)
WHOLE_REQUEST = {"body", "path", "method"}


def _fingerprint(live: LiveServer, sid: str) -> tuple[int, str]:
    """(step, sha256 of every trainable tensor and its gradient), read in-process."""
    session = live.worker.sessions[sid].engine
    digest = hashlib.sha256()
    with session.resource.lock:  # type: ignore[attr-defined]
        for name, param in sorted(session.policy.trainable.items()):  # type: ignore[attr-defined]
            digest.update(name.encode())
            digest.update(param.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
            grad = param.grad
            if grad is not None:
                digest.update(grad.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        step = int(session.step)
    return step, digest.hexdigest()


def _settle(live: LiveServer, op_id: str) -> str:
    deadline = time.monotonic() + 120
    while True:
        row = live.worker.store.get(OperationRow, op_id)
        assert row is not None
        if row.status in (OP_COMPLETED, OP_FAILED):
            return row.status
        assert time.monotonic() < deadline, f"operation {op_id} never finished"
        time.sleep(0.01)


def _strategies(schema: Any, sid: str, rid: str) -> st.SearchStrategy[Any]:
    pinned = {"session_id": sid, "model_resources_id": rid}
    out = []
    for result in schema.get_all_operations():
        operation = result.ok()
        names = {p.name for p in operation.path_parameters}
        fixed = {k: v for k, v in pinned.items() if k in names}
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            if fixed and not operation.path.endswith(UNPINNED):
                out.append(operation.as_strategy(mode, path_parameters=fixed))
            out.append(operation.as_strategy(mode))
    return st.one_of(out)


def _check_refusal(response: requests.Response) -> None:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    param, message = error["param"], error["message"]
    assert param, f"no param: {error}"
    head = param.split(".")[0].split("[")[0]
    assert param in WHOLE_REQUEST or head in message, f"message does not name {param}: {error}"


@pytest.fixture
def fuzzed(tiny_qwen_dir: Path, tmp_path: Path) -> Any:
    model = [{"name": "tiny-qwen", "location": str(tiny_qwen_dir), **LIMITS}]
    with (
        serve_in_thread(
            tmp_path / "storage", {}, model=model, max_body_bytes=1 << 16, op_inline_wait_s=0
        ) as live,
        live.client() as http,
    ):
        rid = new_resource(http, "tiny-qwen", inactive_timeout=3600)
        sid = new_session(http, rid, lora_config={"rank": 2, "seed": 0})
        yield live, sid, rid


def test_fuzz_the_api_from_its_schema(fuzzed: Any) -> None:
    _fuzz(fuzzed, EXAMPLES)


@pytest.mark.slow
def test_fuzz_long(fuzzed: Any) -> None:
    _fuzz(fuzzed, 10 * EXAMPLES)


def _fuzz(fuzzed: Any, examples: int) -> None:
    live, sid, rid = fuzzed
    schema = schemathesis.openapi.from_dict(live.app.openapi())
    statuses: dict[int, int] = {}
    refusals_checked = 0
    http = requests.Session()
    http.headers["Authorization"] = f"Bearer {TOKEN}"

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=_strategies(schema, sid, rid))
    def one_request(case: Any) -> None:
        nonlocal refusals_checked
        before = _fingerprint(live, sid)
        response = case.call(base_url=live.url, session=http, timeout=120)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert response.status_code < 500, (case.method, case.formatted_path, response.text)
        if response.status_code >= 400:
            _check_refusal(response)
            assert _fingerprint(live, sid) == before, f"refused {case.formatted_path} changed it"
            refusals_checked += 1
            return
        body = response.json()
        is_op = "/operations/" in case.path and case.method.upper() == "POST"
        pinned = is_op and case.path_parameters.get("session_id") == sid
        if pinned and _settle(live, body["id"]) == OP_FAILED:
            assert _fingerprint(live, sid) == before, f"failed {case.formatted_path}"
            refusals_checked += 1

    one_request()
    total = sum(statuses.values())
    print(f"{total} requests, statuses {dict(sorted(statuses.items()))}")
    assert total >= min(examples, 500)
    assert refusals_checked >= total // 4
    assert sid in live.worker.sessions, "the pinned session is still live"
