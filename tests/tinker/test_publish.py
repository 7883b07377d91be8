"""Publish, unpublish and copy_weights on the Tinker face, with two users (alice, bob).

- A published checkpoint is every user's to read (weights_info, a sampling session's
  `model_path`, load_weights, the signed download) and its owner's alone to change: bob's
  delete, unpublish, publish and TTL answer exactly as a missing checkpoint. Unpublishing makes
  it missing to bob again, including the signed URL he was given meanwhile.
- copy_weights gives the caller a new checkpoint of the same weights (the safetensors compare
  equal) that survives the deletion of its source, files included; a retry under the same
  `X-Idempotency-Key` answers the same copy.
- The published flag survives a restart; hostile ids and bodies on each route are a 4xx.
- The tinker 0.38 SDK drives the same (`sdk_scripts/publish.py`).
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file

from tests.api.conftest import LiveServer, serve_in_thread
from tests.cached_venv import run_json
from tests.tinker import tinker_http as th
from tests.tinker.conftest import REPO, SCRIPTS, sdk_env
from trainer.api.keys import KeyRing
from trainer.api.tinker.records import TinkerCheckpoint, TinkerRecords

KEYS = {name: secrets.token_urlsafe(24) for name in ("alice", "bob")}
PROMPT = {"chunks": [{"type": "encoded_text", "tokens": [3, 17, 42]}]}


def keys_file(path: Path) -> KeyRing:
    path.write_text(
        "".join(
            f'[[key]]\nuser = "{name}"\nsha256 = "{hashlib.sha256(key.encode()).hexdigest()}"\n\n'
            for name, key in KEYS.items()
        )
    )
    return KeyRing(path)


@pytest.fixture(scope="module")
def live(tiny_qwen_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    keys = keys_file(tmp_path_factory.mktemp("keys") / "keys.toml")
    storage = tmp_path_factory.mktemp("tinker-publish")
    with serve_in_thread(storage, {th.BASE: tiny_qwen_dir}, keys=keys) as server:
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


def trained_model(http: httpx.Client) -> str:
    """A LoRA model one step away from its (zero-B) start, so its adapter is not trivial."""
    model = th.new_model(http)
    th.ok(http, "/forward_backward", th.fb_body(model))
    th.ok(http, "/optim_step", th.optim_body(model))
    return model


def route(path: str, tail: str = "") -> str:
    """`/training_runs/<run>/checkpoints/<segment>/<name><tail>` of a tinker path."""
    run, checkpoint_id = path.removeprefix("tinker://").split("/", 1)
    return f"/training_runs/{run}/checkpoints/{checkpoint_id}{tail}"


def missing(path: str) -> str:
    """A tinker path of the same shape that names nothing."""
    _, rest = path.removeprefix("tinker://").split("/", 1)
    return f"tinker://session_{uuid.uuid4().hex}:train:0/{rest}"


def masked(response: httpx.Response) -> tuple[int, str]:
    text = re.sub(r"session_[0-9a-f]{32}", "<id>", response.text)
    return response.status_code, text


def sampler_for(http: httpx.Client, path: str) -> httpx.Response:
    session = th.new_session(http)
    body = {"session_id": session, "sampling_session_seq_id": 0, "model_path": path}
    return http.post("/create_sampling_session", json=body)


def sample(http: httpx.Client, path: str) -> list[int]:
    made = sampler_for(http, path)
    assert made.status_code == 200, made.text
    body = {
        "sampling_session_id": made.json()["sampling_session_id"],
        "prompt": PROMPT,
        "num_samples": 1,
        "sampling_params": {"max_tokens": 3, "seed": 0, "temperature": 0.0},
    }
    started = http.post("/asample", json=body)
    assert started.status_code == 200, started.text
    result = th.wait(http, started.json()["request_id"])
    assert "error" not in result, result
    tokens: list[int] = result["sequences"][0]["tokens"]
    return tokens


def download(http: httpx.Client, path: str) -> dict[str, bytes]:
    urls = http.get(route(path, "/external_weights_urls"))
    assert urls.status_code == 200, urls.text
    out = {}
    for name, url in urls.json()["urls"].items():
        got = httpx.get(url)
        assert got.status_code == 200, (name, got.text)
        out[name] = got.content
    return out


def engine_record(live: LiveServer, path: str) -> Any:
    saved = live.app.state.tinker.db.get(TinkerCheckpoint, path)
    assert saved is not None, path
    return live.app.state.worker.checkpoints.get(saved.checkpoint_id)


def listed(http: httpx.Client) -> dict[str, dict[str, Any]]:
    return {c["tinker_path"]: c for c in http.get("/checkpoints").json()["checkpoints"]}


@pytest.fixture(scope="module")
def saved(alice: httpx.Client) -> dict[str, str]:
    """Alice's trained model, its sampler weights and its training state."""
    model = trained_model(alice)
    sampler = th.ok(alice, "/save_weights_for_sampler", {"model_id": model, "path": "pub"})
    state = th.ok(alice, "/save_weights", {"model_id": model, "path": "state"})
    return {"model": model, "sampler": sampler["path"], "state": state["path"]}


def test_published_is_everyones_to_read_and_its_owners_to_change(
    live: LiveServer, alice: httpx.Client, bob: httpx.Client, saved: dict[str, str]
) -> None:
    sampler, state = saved["sampler"], saved["state"]
    # private: bob's reads answer as for a missing checkpoint
    for path in (sampler, state):
        theirs = bob.post("/weights_info", json={"tinker_path": path})
        gone = bob.post("/weights_info", json={"tinker_path": missing(path)})
        assert theirs.status_code == 404 and masked(theirs) == masked(gone)
    assert sampler_for(bob, sampler).status_code == 404
    before = download(alice, sampler)
    alice_tokens = sample(alice, sampler)

    for path in (sampler, state):
        assert alice.post(route(path, "/publish")).status_code == 200
        assert alice.post(route(path, "/publish")).status_code == 200  # already: no change
    mine = listed(alice)
    assert mine[sampler]["public"] is True and mine[state]["public"] is True
    assert sampler not in listed(bob)  # readable, not bob's own

    # bob reads: weights_info, samples, download, load (its weights are alice's)
    info = bob.post("/weights_info", json={"tinker_path": state})
    assert info.status_code == 200 and info.json()["lora_rank"] == 2
    assert sample(bob, sampler) == alice_tokens
    bobs_sampler = sampler_for(bob, sampler).json()["sampling_session_id"]
    assert download(bob, sampler) == before
    session = th.new_session(bob)
    load = {"session_id": session, "model_seq_id": 0, "path": state}
    loaded = th.ok(bob, "/load_weights", load)["model_id"]
    assert th.forward(bob, loaded) == th.forward(alice, saved["model"])

    # bob's writes answer as for a missing checkpoint, and change nothing
    for path in (sampler, state):
        for method, tail, body in (
            ("DELETE", "", None),
            ("DELETE", "/publish", None),
            ("POST", "/publish", None),
            ("PUT", "/ttl", {"ttl_seconds": 60}),
        ):
            theirs = bob.request(method, route(path, tail), json=body)
            gone = bob.request(method, route(missing(path), tail), json=body)
            assert theirs.status_code == 404, (method, tail, theirs.text)
            assert masked(theirs) == masked(gone), (method, tail)
    assert listed(alice)[state] == mine[state]

    # a URL bob was given while it was public stops working once alice unpublishes it
    urls = bob.get(route(sampler, "/external_weights_urls")).json()["urls"]
    for path in (sampler, state):
        assert alice.delete(route(path, "/publish")).status_code == 200
        assert alice.delete(route(path, "/publish")).status_code == 200
    assert all(httpx.get(url).status_code == 404 for url in urls.values())
    assert bob.post("/weights_info", json={"tinker_path": state}).status_code == 404
    assert sampler_for(bob, sampler).status_code == 404
    # the sampling session bob made while it was public samples it no more
    body = {"sampling_session_id": bobs_sampler, "prompt": PROMPT, "num_samples": 1}
    late = bob.post("/asample", json={**body, "sampling_params": {"max_tokens": 2}})
    assert late.status_code == 404 and "sampling_session_id" in late.text, late.text
    assert bob.get(route(sampler, "/external_weights_urls")).status_code == 404
    assert listed(alice)[sampler]["public"] is False
    assert alice.post("/weights_info", json={"tinker_path": state}).status_code == 200


def test_copy_is_the_callers_own_and_outlives_its_source(
    live: LiveServer, alice: httpx.Client, bob: httpx.Client
) -> None:
    model = trained_model(alice)
    source = th.ok(alice, "/save_weights_for_sampler", {"model_id": model, "path": "src"})["path"]
    tokens = sample(alice, source)
    body = {"source_path": source, "destination_project_id": "proj", "ttl_seconds": 7200}
    refused = bob.post("/copy_weights", json=body)
    gone = bob.post("/copy_weights", json={**body, "source_path": missing(source)})
    assert refused.status_code == 404 and masked(refused) == masked(gone)

    assert alice.post(route(source, "/publish")).status_code == 200
    key = {"X-Idempotency-Key": str(uuid.uuid4())}
    copied = bob.post("/copy_weights", json=body, headers=key)
    assert copied.status_code == 200, copied.text
    path = copied.json()["tinker_path"]
    assert path.endswith("/sampler_weights/src") and path != source
    again = bob.post("/copy_weights", json=body, headers=key)
    assert again.json() == {"tinker_path": path}
    assert listed(bob)[path]["expires_at"] is not None

    # the same weights, in files of their own
    src, dst = engine_record(live, source), engine_record(live, path)
    assert src.id != dst.id and (src.base_model, src.lora_rank) == (dst.base_model, dst.lora_rank)
    adapter = "adapter/adapter_model.safetensors"
    left, right = load_file(src.path / adapter), load_file(dst.path / adapter)
    assert left.keys() == right.keys() and left
    assert all(torch.equal(left[k], right[k]) for k in left)

    # the copy is bob's: alice cannot see it; it outlives its source, files included
    assert alice.post("/weights_info", json={"tinker_path": path}).status_code == 404
    assert alice.post(route(source, "/publish")).status_code == 200
    assert alice.delete(route(source)).status_code == 200
    assert live.app.state.worker.checkpoints.delete(src.id)
    assert not src.path.exists()
    assert sample(bob, path) == tokens
    assert "adapter_model.safetensors" in download(bob, path)
    assert bob.post(route(path, "/publish")).status_code == 200  # bob owns it
    assert bob.delete(route(path)).status_code == 200
    assert bob.post("/weights_info", json={"tinker_path": path}).status_code == 404

    # each mutation is a line of the audit trail, with its user and its answer
    lines = [json.loads(line) for line in (live.storage / "audit.jsonl").read_text().splitlines()]
    seen = {(e["user"], e["method"], e["route"].rsplit("/", 1)[-1], e["status"]) for e in lines}
    assert ("bob", "POST", "copy_weights", 200) in seen
    assert ("bob", "POST", "copy_weights", 404) in seen
    assert ("alice", "POST", "publish", 200) in seen
    assert ("bob", "POST", "publish", 200) in seen


SOURCE = {"source_path": "tinker://r/weights/x", "destination_project_id": "p"}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "source_path"),
        ({**SOURCE, "source_path": "x"}, "source_path"),
        ({**SOURCE, "source_path": "tinker://a/b/c"}, "source_path"),
        ({**SOURCE, "source_path": "tinker://" + "a" * 5000}, "source_path"),
        ({"source_path": "tinker://r/weights/x"}, "destination_project_id"),
        ({"source_path": "tinker://r/weights/x", "session_id": "s"}, "session_id"),
        ({**SOURCE, "ttl_seconds": 5}, "ttl_seconds"),
        ({**SOURCE, "ttl_seconds": 10**12}, "ttl_seconds"),
        ({**SOURCE, "weights_access_token": "t"}, "weights_access_token"),
    ],
)
def test_copy_refuses_a_bad_body_by_its_field(
    bob: httpx.Client, body: dict[str, Any], field: str
) -> None:
    refused = bob.post("/copy_weights", json=body)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == field, refused.text


def test_hostile_ids_are_never_a_5xx(
    alice: httpx.Client, bob: httpx.Client, saved: dict[str, str]
) -> None:
    run = saved["model"]
    bad = ["weights/..", "nope/x", "weights/" + "a" * 300, "weights/a/b", "weights/%00", "x"]
    for checkpoint_id in bad:
        for method in ("POST", "DELETE"):
            answer = bob.request(
                method, f"/training_runs/{run}/checkpoints/{checkpoint_id}/publish"
            )
            assert 400 <= answer.status_code < 500, (method, checkpoint_id, answer.text)
    # alice's session named as the destination of bob's copy: missing
    session = saved["model"].split(":")[0]
    body = {"source_path": missing(saved["state"]), "session_id": session, "model_seq_id": 0}
    assert bob.post("/copy_weights", json=body).status_code == 404
    token = {"X-Tinker-Weights-Access-Token": "t"}
    body = {"source_path": saved["state"], "destination_project_id": "p"}
    assert bob.post("/copy_weights", json=body, headers=token).status_code == 400


def test_the_flag_survives_a_restart(tiny_qwen_dir: Path, tmp_path: Path) -> None:
    keys, storage = keys_file(tmp_path / "keys.toml"), tmp_path / "storage"
    models = {th.BASE: tiny_qwen_dir}
    with serve_in_thread(storage, models, keys=keys) as first, client(first, "alice") as alice:
        model = th.new_model(alice)
        path = th.ok(alice, "/save_weights", {"model_id": model, "path": "kept"})["path"]
        assert alice.post(route(path, "/publish")).status_code == 200
    with (
        serve_in_thread(storage, models, keys=keys) as second,
        client(second, "bob") as bob,
        client(second, "alice") as owner,
    ):
        assert bob.post("/weights_info", json={"tinker_path": path}).status_code == 200
        assert listed(owner)[path]["public"] is True


def as_user(python: Path, live: LiveServer, name: str, *argv: str) -> dict[str, Any]:
    """Run `sdk_scripts/publish.py argv...` with `name`'s key."""
    env = {**sdk_env(live), "TINKER_API_KEY": f"tml-{KEYS[name]}"}
    return run_json(python, [str(SCRIPTS / "publish.py"), *argv], env, 300, REPO)


def test_the_sdk_publishes_copies_and_reads_across_users(
    venv_python: Path, live: LiveServer
) -> None:
    owner = as_user(venv_python, live, "alice", "owner", th.BASE)
    paths = [owner["sampler"], owner["state"], owner["external"]]
    reader = as_user(venv_python, live, "bob", "reader", th.BASE, *paths)
    assert reader["loaded_logprobs"] == pytest.approx(owner["logprobs"], abs=1e-6)
    assert reader["sampled"] == owner["sampled"]
    assert reader["copy"].endswith("/sampler_weights/shared") and reader["copy_listed"]
    assert reader["copy_sampled"] == owner["sampled"]
    assert reader["delete_status"] == reader["unpublish_status"] == 404
    assert any(name.endswith(".safetensors") for name in reader["downloaded"])
    after = as_user(venv_python, live, "alice", "unpublish", th.BASE, owner["sampler"])
    assert after["public"] is False
    denied = as_user(venv_python, live, "bob", "denied", th.BASE, owner["sampler"])
    assert denied["status"] == 404


def test_a_store_from_before_the_flag_reads_as_private(tmp_path: Path) -> None:
    """tinker.sqlite written before `public` existed: its checkpoints open private."""
    path = tmp_path / "tinker.sqlite"
    with sqlite3.connect(path) as db:
        db.execute(
            "CREATE TABLE checkpoints (path TEXT PRIMARY KEY, run_id TEXT, kind TEXT, name TEXT, "
            "checkpoint_id TEXT, created_at REAL, expires_at REAL, user_metadata TEXT)"
        )
        db.execute(
            "INSERT INTO checkpoints VALUES ('tinker://r/weights/x', 'r', 'training', 'x', "
            "'ckpt-0', 1.0, NULL, NULL)"
        )
    records = TinkerRecords(path)
    try:
        old = records.get(TinkerCheckpoint, "tinker://r/weights/x")
        assert old is not None and old.public is False
        records.update(TinkerCheckpoint, old.path, public=True)
        assert records.select(TinkerCheckpoint, "public = 1")[0].path == old.path
    finally:
        records.close()
