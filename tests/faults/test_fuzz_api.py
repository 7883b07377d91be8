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

Path and query parameters get their own fuzz (`test_fuzz_path_and_query_parameters`): every
parameter of every route (the schema's, plus those read undeclared: `status`, `expires`, `sig`)
with a sweep of hostile values (NUL, Unicode digits, 5,000-digit numbers, traversal, long text),
then random full-Unicode text (`TRAINER_FUZZ_PARAM_EXAMPLES`, default 200; 15x under
`TRAINER_SLOW=1`), genuine ids and signatures mixed in so the values reach the handlers.
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
from trainer.serving.catalogue import OP_COMPLETED, OP_FAILED, OperationRow

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


# -- path and query parameters, with full Unicode ----------------------------------------------

PARAM_EXAMPLES = int(os.environ.get("TRAINER_FUZZ_PARAM_EXAMPLES", "200"))
# Query parameters the routes read without declaring them in the schema.
EXTRA_QUERY = {
    "/v1/rl/model-resources": ("status", "status[]"),
    "/v1/rl/training-sessions": ("status", "status[]"),
    "/v1/rl/files/checkpoints/{checkpoint_id}/{variant}/{filename}": ("expires", "sig"),
    "/v1/rl/payloads/{session_id}/{payload_id}": ("expires", "sig"),
}
# Every code point but surrogates (HTTP carries UTF-8), NUL and controls included.
UNICODE = st.characters(exclude_categories=("Cs",))
VALUES = st.one_of(
    st.text(UNICODE, max_size=24),
    # Unicode digits that str.isdigit() accepts: int() takes "٣" and refuses "²"
    st.text(st.characters(categories=("Nd", "No")).filter(str.isdigit), min_size=1, max_size=6),
    st.integers(4_301, 6_000).map(lambda n: "9" * n),  # past int()'s 4,300-digit limit
    st.integers(-(10**30), 10**30).map(str),
)


def _routes(schema: dict[str, Any]) -> list[tuple[str, str, list[str], list[str]]]:
    """(method, path template, path parameter names, query parameter names) of every route."""
    out = []
    for path, item in schema["paths"].items():
        for method, op in item.items():
            params = op.get("parameters", [])
            names = [p["name"] for p in params if p["in"] == "path"]
            query = [p["name"] for p in params if p["in"] == "query"]
            out.append((method.upper(), path, names, [*query, *EXTRA_QUERY.get(path, ())]))
    return out


def test_fuzz_path_and_query_parameters(fuzzed: Any) -> None:
    _fuzz_params(fuzzed, PARAM_EXAMPLES)


@pytest.mark.slow
def test_fuzz_path_and_query_parameters_long(fuzzed: Any) -> None:
    _fuzz_params(fuzzed, 15 * PARAM_EXAMPLES)


NASTY = [
    "\0",
    "²",  # isdigit() and int() disagree
    "٣",  # int() reads 3
    "9" * 5_000,  # past int()'s 4,300-digit limit
    "-1",
    "1e400",
    "../../etc/passwd",
    "x" * 5_000,
    "\u202e\U0001f600\r\n",
    "%00",
]


def _fuzz_params(fuzzed: Any, examples: int) -> None:
    """Any text in any path segment or query parameter (genuine ids and signatures mixed in, so
    the values reach the handlers): never a 5xx, every refusal names its field, and the pinned
    session is untouched. First a sweep (each parameter of each route with each `NASTY`
    value), then `examples` random requests with hypothesis' full Unicode."""
    from urllib.parse import parse_qsl, quote, urlencode, urlsplit

    import httpx

    live, sid, rid = fuzzed
    with live.client() as http:
        ckpt = http.post(
            f"/rl/training-sessions/{sid}/operations/inference-checkpoint",
            headers={"Idempotency-Key": "fuzz-ckpt"},
        ).json()
        _settle(live, ckpt["id"])
        ckpt_id = live.worker.store.get(OperationRow, ckpt["id"]).output["checkpoint"]["id"]
        files = http.get(
            f"/rl/checkpoints/{ckpt_id}/download", params={"variant": "CHECKPOINT_VARIANT_ADAPTER"}
        ).json()["data"]
        upload = http.post(f"/rl/training-sessions/{sid}/payloads/upload-url").json()
        assert httpx.put(upload["upload_url"], content=b"{}").status_code == 200
    signed = {
        "GET /v1/rl/files/checkpoints/{checkpoint_id}/{variant}/{filename}": files[0]["url"],
        "PUT /v1/rl/payloads/{session_id}/{payload_id}": upload["upload_url"],
    }
    pinned = {
        "session_id": sid,
        "model_resources_id": rid,
        "checkpoint_id": ckpt_id,
        "variant": "ADAPTER",
        "filename": files[0]["filename"],
        "payload_id": upload["payload_id"],
        "operation_id": ckpt["id"],
    }
    routes = [r for r in _routes(live.app.openapi()) if r[1] != "/healthz"]
    before = _fingerprint(live, sid)
    statuses: dict[int, int] = {}
    client = httpx.Client(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120)

    def send(
        method: str, template: str, path_values: dict[str, str], query: list[tuple[str, str]]
    ) -> None:
        path = template
        for name, value in path_values.items():
            path = path.replace(f"{{{name}}}", quote(value, safe=""))
        url = f"{live.url}{path}" + (f"?{urlencode(query, quote_via=quote)}" if query else "")
        body = {} if method in ("POST", "PUT", "PATCH") else None
        response = client.request(method, url, json=body)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert response.status_code < 500, (method, url[:300], response.text[:300])
        if response.status_code >= 400:
            _check_refusal(response)  # type: ignore[arg-type]

    def genuine_query(method: str, template: str) -> list[tuple[str, str]]:
        url = signed.get(f"{method} {template}")
        return parse_qsl(urlsplit(url).query) if url else []

    def safe_ids(template: str, names: list[str]) -> dict[str, str]:
        stops = template.endswith("/stop")  # a pinned id there would end the session under test
        return {n: ("x" if stops else pinned.get(n, "x")) for n in names}

    try:
        for method, template, names, query_names in routes:  # the sweep
            base = safe_ids(template, names)
            for value in NASTY:
                for name in names:
                    send(method, template, {**base, name: value}, [])
                for name in query_names:
                    query = [(k, v) for k, v in genuine_query(method, template) if k != name]
                    send(method, template, base, [*query, (name, value)])

        # half the draws go to routes that read query parameters, so values reach their parsers
        route = st.one_of(st.sampled_from([r for r in routes if r[3]]), st.sampled_from(routes))

        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            derandomize=True,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(data=st.data())
        def one_request(data: st.DataObject) -> None:
            method, template, names, query_names = data.draw(route)
            stops = template.endswith("/stop")
            path_values = {}
            for name in names:
                keep = name in pinned and not stops and data.draw(st.booleans())
                path_values[name] = pinned[name] if keep else data.draw(VALUES)
            query: list[tuple[str, str]] = []
            if path_values == safe_ids(template, names) and data.draw(st.booleans()):
                query = genuine_query(method, template)  # a valid signature, one value fuzzed
            names_drawn = st.lists(st.sampled_from([*query_names, "x"]), min_size=1, max_size=3)
            for name in data.draw(names_drawn):
                query = [(k, v) for k, v in query if k != name] + [(name, data.draw(VALUES))]
            send(method, template, path_values, query)

        one_request()
    finally:
        client.close()
    print(f"{sum(statuses.values())} requests, statuses {dict(sorted(statuses.items()))}")
    assert _fingerprint(live, sid) == before
    assert sid in live.worker.sessions, "the pinned session is still live"
    assert sum(v for k, v in statuses.items() if k >= 400) >= sum(statuses.values()) // 2
