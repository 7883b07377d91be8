"""Tenants on the Tinker face: user B's requests that name user A's Tinker sessions, models,
futures, samplers, runs and `tinker://` paths get exactly the answer a missing object gets.

The walk covers the face's route table (`tinker_http.face_routes`): a route added later that
names an object must be listed in `ROUTES` (or in `NO_OBJECT`), or the test fails.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.conftest import LiveServer, serve_in_thread
from tests.tinker import tinker_http as th
from trainer.api.keys import KeyRing

KEYS = {name: secrets.token_urlsafe(24) for name in ("alice", "bob", "root")}

# routes that name no object of anyone (service, config, creates without a parent)
NO_OBJECT = {
    ("GET", "/api/v1/healthz"),
    ("GET", "/api/v1/get_server_capabilities"),
    ("POST", "/api/v1/client/config"),
    ("POST", "/api/v1/client/dynamic_config"),
    ("POST", "/api/v1/telemetry"),
    ("POST", "/api/v1/create_session"),
    ("POST", "/api/v1/retrieve_futures"),  # not served
    ("GET", "/api/v1/training_runs"),  # listings: test_listings_are_per_user
    ("GET", "/api/v1/list_checkpoints"),  # the caller's names (tests/fireworks)
    ("GET", "/api/v1/checkpoints"),
    ("GET", "/api/v1/sessions"),
}


@pytest.fixture(scope="module")
def live(tiny_qwen_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    path.write_text(
        "".join(
            f'[[key]]\nuser = "{name}"\nsha256 = "{hashlib.sha256(key.encode()).hexdigest()}"\n'
            f"admin = {str(name == 'root').lower()}\n\n"
            for name, key in KEYS.items()
        )
    )
    storage = tmp_path_factory.mktemp("tinker-tenants")
    with serve_in_thread(storage, {th.BASE: tiny_qwen_dir}, keys=KeyRing(path)) as server:
        yield server


def client(live: LiveServer, name: str) -> httpx.Client:
    return th.client(live, **{"X-API-Key": f"tml-{KEYS[name]}"})


@pytest.fixture(scope="module")
def alice(live: LiveServer) -> Iterator[httpx.Client]:
    with client(live, "alice") as http:
        yield http


@pytest.fixture(scope="module")
def bob(live: LiveServer) -> Iterator[httpx.Client]:
    with client(live, "bob") as http:
        yield http


@pytest.fixture(scope="module")
def work(alice: httpx.Client) -> dict[str, Any]:
    """Alice's Tinker objects: a session, a model, a saved state, a sampler, a future."""
    session = th.new_session(alice)
    model = th.new_model(alice, session)
    bodies = th.valid_bodies(alice, model)  # saves `tinker://<model>/weights/valid`
    future = alice.post("/forward_backward", json=th.fb_body(model, forward_only=True)).json()
    th.wait(alice, future["request_id"])
    made = alice.post(
        "/create_sampling_session",
        json={"session_id": session, "sampling_session_seq_id": 1, "base_model": th.BASE},
    )
    assert made.status_code == 200, made.text
    sampler = made.json()["sampling_session_id"]
    return {
        "session": session,
        "model": model,
        "bodies": bodies,
        "future": future["request_id"],
        "sampler": sampler,
        "path": bodies["/weights_info"]["tinker_path"],
    }


def _bob_call(work: dict[str, Any], method: str, path: str) -> tuple[str, str, Any]:
    """(method, url, body) of `path` naming alice's objects."""
    route = path.removeprefix(th.PREFIX)
    ids = {
        "session_id": work["session"],
        "run_id": work["model"],
        "checkpoint_id": "weights/valid",
        "sampler_id": work["sampler"],
    }
    url = re.sub(r"\{(\w+)(:path)?\}", lambda m: ids[m.group(1)], route)
    body: Any = None
    if method == "POST":
        body = dict(work["bodies"].get(route, {}))
        if route == "/retrieve_future":
            body = {"request_id": work["future"]}
        if route == "/asample":
            body = {**body, "sampling_session_id": work["sampler"]}
            body.pop("base_model", None)
        if route == "/sessions/{session_id}/finish":
            body = {}
    if method == "PUT":
        body = {"ttl_seconds": 60}
    return method, url, body


def _missing(work: dict[str, Any], text: str) -> str:
    """`text` with each of alice's ids replaced by one that names nothing."""
    out = text
    fresh = {
        work["session"]: f"session_{uuid.uuid4().hex}",
        work["future"]: f"req_{uuid.uuid4().hex}",
    }
    for old, new in fresh.items():
        out = out.replace(old, new)
    return out


def _normal(text: str) -> str:
    return re.sub(r"(session|req)_[0-9a-f]{32}", "<id>", text)


def test_every_route_answers_another_users_object_as_a_missing_one(
    live: LiveServer, bob: httpx.Client, work: dict[str, Any]
) -> None:
    walked = []
    for method, path in th.face_routes(live.app):
        if (method, path) in NO_OBJECT or "{route" in path:
            continue
        method, url, body = _bob_call(work, method, path)
        content = None if body is None else json.dumps(body)
        headers = {"Content-Type": "application/json"}
        theirs = bob.request(method, url, content=content, headers=headers)
        gone_url = _missing(work, url)
        gone = bob.request(
            method,
            gone_url,
            content=None if content is None else _missing(work, content),
            headers=headers,
        )
        assert theirs.status_code == 404, (method, path, theirs.status_code, theirs.text)
        assert gone.status_code == 404, (method, path, gone.text)
        assert _normal(theirs.text) == _normal(gone.text), (method, path)
        walked.append((method, path))
    assert len(walked) >= 20, walked


def test_alice_still_reaches_her_own(alice: httpx.Client, work: dict[str, Any]) -> None:
    assert alice.post("/get_info", json={"model_id": work["model"]}).status_code == 200
    assert alice.get(f"/training_runs/{work['model']}").json()["model_owner"] == "alice"
    assert alice.get(f"/samplers/{work['sampler']}").status_code == 200


def test_listings_are_per_user(
    live: LiveServer, alice: httpx.Client, bob: httpx.Client, work: dict[str, Any]
) -> None:
    assert work["session"] in alice.get("/sessions").json()["sessions"]
    assert bob.get("/sessions").json()["sessions"] == []
    runs = [r["training_run_id"] for r in alice.get("/training_runs").json()["training_runs"]]
    assert work["model"] in runs
    assert bob.get("/training_runs").json()["training_runs"] == []
    assert alice.get("/checkpoints").json()["checkpoints"]
    assert bob.get("/checkpoints").json()["checkpoints"] == []
    with client(live, "root") as root:
        everyone = root.get("/training_runs").json()["training_runs"]
        assert work["model"] in [r["training_run_id"] for r in everyone]
    # the RL face lists alice's Tinker model as her training session, not bob's
    with live.client(KEYS["bob"]) as rl_bob, live.client(KEYS["alice"]) as rl_alice:
        assert rl_bob.get("/rl/training-sessions").json()["data"] == []
        theirs = rl_alice.get("/rl/training-sessions").json()["data"]
        assert theirs and all(s["created_by"] == "alice" for s in theirs)
