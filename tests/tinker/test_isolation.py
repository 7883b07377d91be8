"""Tenants closed for good on the Tinker face (docs/semantics.md §21).

- The walk: every route of the face's route table, with bob's own objects in every slot but
  one, and in that one (each path parameter, and each id-like body field the face knows, on
  every POST route, read by it or not) each of alice's real ids and paths, then a missing one:
  the same answer byte for byte once hex ids are masked, never a 5xx. A route added later is
  walked without anyone listing it.
- An ad-hoc sampler carries its owner: after alice samples her checkpoint ad hoc, bob naming
  that sampler (in any spelling of its id) gets the 404 of a missing one.
- A save refused by the storage quota fails with `category: "user"`.
- Stop strings on a model without a tokenizer are a 400 at the door.
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

KEYS = {name: secrets.token_urlsafe(24) for name in ("alice", "bob", "carol", "root")}
HEX = re.compile(r"[0-9a-f]{32}")
# every body field of the face that names an object (a Tinker id, a future or a path)
ID_FIELDS = (
    "model_id",
    "session_id",
    "sampling_session_id",
    "request_id",
    "path",
    "tinker_path",
    "model_path",
)
SAMPLE = {
    "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
    "num_samples": 1,
    "sampling_params": {"max_tokens": 2, "seed": 0},
}


def _keys_file(path: Path) -> Path:
    entries = []
    for name, key in KEYS.items():
        digest = hashlib.sha256(key.encode()).hexdigest()
        admin = str(name == "root").lower()
        text = f'[[key]]\nuser = "{name}"\nsha256 = "{digest}"\nadmin = {admin}\n'
        if name == "carol":
            text += "[key.quotas]\nmax_storage_bytes = 1\n"
        entries.append(text)
    path.write_text("\n".join(entries))
    return path


@pytest.fixture(scope="module")
def live(tiny_qwen_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    tmp = tmp_path_factory.mktemp("tinker-isolation")
    ring = KeyRing(_keys_file(tmp / "keys.toml"))
    with serve_in_thread(tmp / "storage", {th.BASE: tiny_qwen_dir}, keys=ring) as server:
        yield server


@pytest.fixture(scope="module")
def users(live: LiveServer) -> Iterator[dict[str, httpx.Client]]:
    clients = {n: th.client(live, **{"X-API-Key": f"tml-{k}"}) for n, k in KEYS.items()}
    yield clients
    for http in clients.values():
        http.close()


def objects(http: httpx.Client) -> dict[str, Any]:
    """A user's Tinker objects: a session, models, saved states, a sampler, futures, and an
    ad-hoc sample of its own sampler checkpoint."""
    session = th.new_session(http)
    model = th.new_model(http, session)
    victim = th.new_model(http, session, seq=1)  # what load_weights / unload_model name
    bodies = th.valid_bodies(http, model, victim)
    saved = th.ok(http, "/save_weights_for_sampler", {"model_id": model, "path": "s"})["path"]
    made = http.post(
        "/create_sampling_session",
        json={"session_id": session, "sampling_session_seq_id": 1, "model_path": saved},
    )
    assert made.status_code == 200, made.text
    adhoc = http.post("/asample", json={**SAMPLE, "model_path": saved})
    assert adhoc.status_code == 200, adhoc.text
    assert "error" not in th.wait(http, adhoc.json()["request_id"])
    return {
        "session": session,
        "model": model,
        "bodies": bodies,
        "path": bodies["/weights_info"]["tinker_path"],
        "sampler_path": saved,
        "sampler": made.json()["sampling_session_id"],
        "future": adhoc.json()["request_id"],
    }


@pytest.fixture(scope="module")
def work(users: dict[str, httpx.Client]) -> dict[str, dict[str, Any]]:
    return {"alice": objects(users["alice"]), "bob": objects(users["bob"])}


def fresh(value: str) -> str:
    return HEX.sub(lambda _: uuid.uuid4().hex, value)


def masked(response: httpx.Response) -> tuple[int, str]:
    return response.status_code, HEX.sub("<hex>", response.text)


def alice_values(alice: dict[str, Any], user: str = "alice") -> list[str]:
    """Each of alice's ids and paths, and her ad-hoc sampler's id in each spelling."""
    ids = [alice[k] for k in ("session", "model", "sampler", "future", "path", "sampler_path")]
    return [*ids, f"adhoc:{alice['sampler_path']}", f"adhoc:{user}:{alice['sampler_path']}"]


def test_another_users_adhoc_sampler_is_missing(
    users: dict[str, httpx.Client], work: dict[str, dict[str, Any]]
) -> None:
    bob, alice = users["bob"], users["alice"]
    theirs = work["alice"]["sampler_path"]
    for sampler_id in (f"adhoc:{theirs}", f"adhoc:alice:{theirs}"):
        for field, value in (("sampling_session_id", sampler_id), ("model_path", theirs)):
            named = bob.post("/asample", json={**SAMPLE, field: value})
            gone = bob.post("/asample", json={**SAMPLE, field: fresh(value)})
            assert named.status_code == 404, (field, value, named.text)
            assert masked(named) == masked(gone), (field, value)
    # her own ad-hoc sampler is still hers
    again = alice.post("/asample", json={**SAMPLE, "sampling_session_id": f"adhoc:alice:{theirs}"})
    assert again.status_code == 200, again.text


def test_a_save_past_the_storage_quota_is_the_users_failure(
    users: dict[str, httpx.Client],
) -> None:
    carol = users["carol"]
    model = th.new_model(carol)
    for route in ("/save_weights", "/save_weights_for_sampler"):
        started = carol.post(route, json={"model_id": model, "path": "big"})
        assert started.status_code == 200, started.text
        failed = th.wait(carol, started.json()["request_id"])
        assert failed["category"] == "user", (route, failed)
        assert "max_storage_bytes" in failed["error"], (route, failed)


def test_stop_strings_without_a_tokenizer_are_a_400_at_the_door(
    users: dict[str, httpx.Client], work: dict[str, dict[str, Any]]
) -> None:
    bob = users["bob"]
    body = {**SAMPLE, "base_model": th.BASE, "sampling_params": {"max_tokens": 2, "stop": "x"}}
    refused = bob.post("/asample", json=body)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "sampling_params.stop" and "tokenizer" in error["message"]


def _bob_request(
    bob: dict[str, Any], method: str, path: str, slot: str, value: str
) -> tuple[str, Any]:
    """(url, body) of `path` naming bob's objects, with `slot` (a path parameter or a body
    field) set to `value`."""
    route = path.removeprefix(th.PREFIX)
    ids = {
        "session_id": bob["session"],
        "run_id": bob["model"],
        "checkpoint_id": "weights/valid",
        "sampler_id": bob["sampler"],
    }

    def fill(match: re.Match[str]) -> str:
        return value if match.group(1) == slot else str(ids[match.group(1)])

    url = re.sub(r"\{(\w+)(:path)?\}", fill, route)
    body: Any = None
    if method == "POST":
        body = json.loads(json.dumps(bob["bodies"].get(route, {})))
        if route == "/retrieve_future":
            body = {"request_id": bob["future"]}
        if slot in ID_FIELDS and "{" + slot not in path:
            body[slot] = value
    if method == "PUT":
        body = {"ttl_seconds": 60}
    return url, body


def test_every_slot_of_every_route_answers_another_users_object_as_a_missing_one(
    live: LiveServer, users: dict[str, httpx.Client], work: dict[str, dict[str, Any]]
) -> None:
    bob = users["bob"]
    walked = set()
    for method, path in th.face_routes(live.app):
        params = re.findall(r"\{(\w+)(?::path)?\}", path)
        if "route" in params:
            continue  # the catch-all for routes the face does not serve
        slots = params + (list(ID_FIELDS) if method == "POST" else [])
        for slot in slots:
            for value in alice_values(work["alice"]):
                answers = []
                for sent in (value, fresh(value)):
                    url, body = _bob_request(work["bob"], method, path, slot, sent)
                    content = None if body is None else json.dumps(body)
                    headers = {"Content-Type": "application/json"}
                    answers.append(bob.request(method, url, content=content, headers=headers))
                assert answers[0].status_code < 500, (method, path, slot, answers[0].text)
                assert masked(answers[0]) == masked(answers[1]), (method, path, slot, value)
            walked.add((method, path, slot))
    assert len(walked) >= 100, sorted(walked)
    assert ("POST", "/api/v1/asample", "sampling_session_id") in walked
