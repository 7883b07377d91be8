"""Tenants closed for good on the RL session API: no path, cursor, metric or signed URL crosses
a user (docs/semantics.md §21).

- The walk: every route of the served OpenAPI schema under `/v1/rl`, with bob's own objects in
  every slot but one, and in that one (each id-like path parameter, query parameter and body
  field, the schema's and the operation bodies' `payload_id`) each of alice's real ids, then a
  missing id: the two answers are the same, byte for byte once hex ids are masked, never a 5xx.
  A route or a field added later is walked without anyone listing it. Every mounted route is
  either walked here, walked by the Tinker face's walk, or named as taking no object.
- `resume_from_hf_checkpoint` names no directory of the storage, whatever the spelling: one
  400 pointing at `resume_from_checkpoint_id` for alice's checkpoint and a missing one alike.
- `after` cursors, `worker-metrics`, the audit line of a signed-URL upload, stop strings
  without a tokenizer.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.conftest import serve_in_thread
from tests.api.team_helpers import team
from tests.faults.procs import CE, ce_sample, model_input, new_resource, new_session, run_op
from trainer.api.audit import mounted_routes

HEX = re.compile(r"[0-9a-f]{32}")
ID_LIKE = re.compile(r"(^|_)(id|ref|after)$|_checkpoint$")
USER_LIKE = {"created_by"}
# operation bodies name an uploaded payload outside the schema (the SDK's offload)
HIDDEN_FIELDS = {"/operations/": ("payload_id",)}
# a body of bob's that the route would take, for the routes whose body is checked first
BASE_BODIES: dict[str, dict[str, Any]] = {
    "POST /v1/rl/model-resources": {"base_model": "tiny-qwen", "lora_enabled": False},
    "POST /v1/rl/model-resources/estimate-cost": {"base_model": "tiny-qwen"},
    "POST /v1/rl/training-sessions": {"model_resources_id": "<bob:model_resources_id>"},
    "POST /v1/rl/model-resources/{model_resources_id}/extend-expiry": {"seconds": 3600},
    "PATCH /v1/rl/training-sessions/{session_id}": {"display_name": "x"},
}
# mounted routes that name no object of anyone's, or are checked by their own tests
NO_OBJECT = {
    "/healthz",
    "/metrics",  # admin only: tests/api/test_metrics.py
    "/v1/openapi.json",
    "/v1/rl/audit",  # admin only: tests/api/test_audit.py
    "/v1/rl/supported-models",
    "/v1/rl/worker-metrics",  # per user: test_worker_metrics_are_per_user
}
TINKER_PREFIX = "/api/v1"  # walked by tests/tinker/test_isolation.py
FIREWORKS_PREFIX = "/v1/accounts"  # walked by tests/fireworks/test_control_plane.py
HOT_LOAD = "/hot_load/"  # walked by tests/fireworks/test_deployments.py
# test_completions_rules.py (both routes), test_chat_completions.py
COMPLETIONS = ("/inference/v1/completions", "/v1/completions", "/inference/v1/chat/completions")
COMPLETIONS += ("/v1/chat/completions",)
SERVERLESS = "/training/v1/serverless/"  # walked by tests/fireworks/test_serverless.py


@pytest.fixture(scope="module")
def live(tiny_qwen_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    tmp = tmp_path_factory.mktemp("isolation")
    ring, keys = team(tmp)
    roots = tmp / "resume-roots"
    roots.mkdir()
    models = {"tiny-qwen": tiny_qwen_dir}
    with serve_in_thread(tmp / "storage", models, None, ring, resume_roots=[roots]) as server:
        yield server, keys, roots


@pytest.fixture(scope="module")
def users(live: Any) -> Iterator[dict[str, httpx.Client]]:
    server, keys, _ = live
    clients = {name: server.client(key) for name, key in keys.items()}
    yield clients
    for http in clients.values():
        http.close()


def objects(http: httpx.Client) -> dict[str, str]:
    """A user's objects: a resource, a session, an operation, checkpoints, a payload."""
    rid = new_resource(http, "tiny-qwen")
    sid = new_session(http, rid, lora_config={"rank": 4, "seed": 0})
    body = {"loss": CE, "samples": [ce_sample([1, 2, 3])], "forward_only": True}
    op = run_op(http, sid, "forward-backward", body)
    training = run_op(http, sid, "training-checkpoint")["output"]["checkpoint"]["id"]
    inference = run_op(http, sid, "inference-checkpoint")["output"]["checkpoint"]["id"]
    upload = http.post(f"/rl/training-sessions/{sid}/payloads/upload-url").json()
    assert httpx.put(upload["upload_url"], content=b'{"samples": []}').status_code == 200
    return {
        "model_resources_id": rid,
        "session_id": sid,
        "operation_id": op["id"],
        "checkpoint_id": inference,
        "training_checkpoint_id": training,
        "payload_id": upload["payload_id"],
    }


@pytest.fixture(scope="module")
def work(users: dict[str, httpx.Client]) -> dict[str, dict[str, str]]:
    """Alice's objects, then bob's (made after hers: their rows sort after hers)."""
    return {"alice": objects(users["alice"]), "bob": objects(users["bob"])}


def fresh(value: str) -> str:
    """`value` with each hex id replaced by one that names nothing."""
    return HEX.sub(lambda _: uuid.uuid4().hex, value)


def masked(response: httpx.Response) -> tuple[int, str]:
    return response.status_code, HEX.sub("<hex>", response.text)


def storage_spellings(storage: Path, roots: Path, checkpoint_id: str) -> list[str]:
    """One checkpoint directory as a client could spell it: absolute, relative to the worker's
    directory, through `..`, with trailing slashes, as a file:// URL, through a symlink in a
    resume root (made here; a missing checkpoint's link dangles)."""
    adapter = storage / "checkpoints" / checkpoint_id / "adapter"
    link = roots / f"link-{checkpoint_id}"
    if not link.is_symlink():
        link.symlink_to(adapter)
    return [
        str(adapter),
        os.path.relpath(adapter),
        str(storage / "checkpoints" / ".." / "checkpoints" / checkpoint_id / "adapter"),
        f"{adapter}//",
        f"file://{adapter}",
        str(link),
    ]


# --------------------------------------------------------------------------------------------
# items 1 and 6: storage paths in resume_from_hf_checkpoint
# --------------------------------------------------------------------------------------------


def test_resume_from_hf_checkpoint_names_no_storage_directory(
    live: Any, users: dict[str, httpx.Client], work: dict[str, dict[str, str]]
) -> None:
    server, _, roots = live
    bob, alice = users["bob"], users["alice"]
    rid = work["bob"]["model_resources_id"]
    sessions = len(server.worker.store.sessions_of(rid))
    theirs = work["alice"]["checkpoint_id"]
    gone = fresh(theirs)
    field = "resume_from_hf_checkpoint"
    for spelled, missing in zip(
        storage_spellings(server.storage, roots, theirs),
        storage_spellings(server.storage, roots, gone),
        strict=True,
    ):
        answers = []
        for location in (spelled, missing):
            body = {"model_resources_id": rid, field: location}
            answers.append(bob.post("/rl/training-sessions", json=body))
        assert answers[0].status_code == 400, (spelled, answers[0].text)
        error = answers[0].json()["error"]
        assert error["param"] == field and "resume_from_checkpoint_id" in error["message"]
        assert masked(answers[0]) == masked(answers[1]), spelled
    assert len(server.worker.store.sessions_of(rid)) == sessions  # nothing opened
    # her own checkpoint is named by id, not by its directory, for her too
    own = {"model_resources_id": work["alice"]["model_resources_id"], field: spelled}
    assert alice.post("/rl/training-sessions", json=own).status_code == 400


# --------------------------------------------------------------------------------------------
# item 3: worker metrics
# --------------------------------------------------------------------------------------------


def test_worker_metrics_are_per_user(
    users: dict[str, httpx.Client], work: dict[str, dict[str, str]]
) -> None:
    seen = {
        name: users[name].get("/rl/worker-metrics").json()["per_resource"]
        for name in ("alice", "bob", "root")
    }
    alice_rid, bob_rid = (work[n]["model_resources_id"] for n in ("alice", "bob"))
    assert alice_rid in seen["alice"] and bob_rid not in seen["alice"]
    assert bob_rid in seen["bob"] and alice_rid not in seen["bob"]
    assert {alice_rid, bob_rid} <= set(seen["root"])
    totals = users["bob"].get("/rl/worker-metrics").json()
    assert totals["passes"] == sum(c["passes"] for c in seen["bob"].values())


# --------------------------------------------------------------------------------------------
# item 4: cursors
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/rl/model-resources", "model_resources_id"),
        ("/rl/training-sessions", "session_id"),
        ("/rl/checkpoints", "checkpoint_id"),
    ],
)
def test_a_cursor_of_another_user_reads_as_a_missing_one(
    users: dict[str, httpx.Client], work: dict[str, dict[str, str]], path: str, kind: str
) -> None:
    bob = users["bob"]
    theirs = work["alice"][kind]
    assert bob.get(path).json()["data"], "bob has rows after alice's"
    after_theirs = bob.get(path, params={"after": theirs})
    after_nothing = bob.get(path, params={"after": fresh(theirs)})
    assert masked(after_theirs) == masked(after_nothing), after_theirs.text


# --------------------------------------------------------------------------------------------
# item 7: the audit line of a signed-URL upload names its user
# --------------------------------------------------------------------------------------------


def test_signed_url_calls_are_audited_with_their_user(
    live: Any, work: dict[str, dict[str, str]]
) -> None:
    server, _, _ = live
    lines = [json.loads(x) for x in (server.storage / "audit.jsonl").read_text().splitlines()]
    puts = [e for e in lines if e["method"] == "PUT" and e["route"].startswith("/v1/rl/payloads")]
    by_session = {e["ids"]["session_id"]: e["user"] for e in puts}
    assert by_session[work["alice"]["session_id"]] == "alice"
    assert by_session[work["bob"]["session_id"]] == "bob"


# --------------------------------------------------------------------------------------------
# item 9: stop strings on a model without a tokenizer
# --------------------------------------------------------------------------------------------


def test_stop_strings_without_a_tokenizer_are_a_400_at_the_door(
    users: dict[str, httpx.Client], work: dict[str, dict[str, str]]
) -> None:
    bob, sid = users["bob"], work["bob"]["session_id"]
    body = {
        "model_inputs": [model_input([1, 2, 3])],
        "sampling_params": {"max_tokens": 2, "stop": ["x"]},
    }
    url = f"/rl/training-sessions/{sid}/operations/sample"
    refused = bob.post(url, json=body, headers={"Idempotency-Key": uuid.uuid4().hex})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "sampling_params.stop" and "tokenizer" in error["message"]
    with_ids = {**body, "sampling_params": {"max_tokens": 2, "stop_token_ids": [5]}}
    done = run_op(bob, sid, "sample", with_ids)
    assert done["status"].endswith("COMPLETED"), done


# --------------------------------------------------------------------------------------------
# the class: every route, every id-like slot, another user's real ids
# --------------------------------------------------------------------------------------------


def _body_fields(schema: dict[str, Any], operation: dict[str, Any]) -> list[str]:
    content = operation.get("requestBody", {}).get("content", {}).get("application/json", {})
    body = content.get("schema", {})
    if "$ref" in body:
        body = schema["components"]["schemas"][body["$ref"].rsplit("/", 1)[-1]]
    return list(body.get("properties", {}))


def slots(schema: dict[str, Any], path: str, operation: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, name) of each id-like slot of a route: path, query or body."""
    found = [
        (p["in"], p["name"])
        for p in operation.get("parameters", [])
        if p["in"] in ("path", "query") and (ID_LIKE.search(p["name"]) or p["name"] in USER_LIKE)
    ]
    fields = _body_fields(schema, operation)
    fields += [f for marker, extra in HIDDEN_FIELDS.items() if marker in path for f in extra]
    found += [("body", f) for f in fields if ID_LIKE.search(f)]
    return found


def values(name: str, alice: dict[str, str], storage: Path, roots: Path) -> list[tuple[str, str]]:
    """(alice's, a missing one) for slot `name`: each of her ids (a user slot: her user id); a
    directory slot also each spelling of her checkpoints' directories."""
    if name in USER_LIKE:
        return [("alice", "nobody")]
    out = [(value, fresh(value)) for value in alice.values()]
    if name.endswith("_checkpoint"):
        theirs = alice["checkpoint_id"]
        spelled = storage_spellings(storage, roots, theirs)
        out += zip(spelled, storage_spellings(storage, roots, fresh(theirs)), strict=True)
    return out


def _request(
    http: httpx.Client, method: str, path: str, slot: tuple[str, str], value: str, bob: dict
) -> httpx.Response:
    where, name = slot
    base = json.loads(json.dumps(BASE_BODIES.get(f"{method.upper()} {path}", {})))
    for key, item in base.items():
        if isinstance(item, str) and item.startswith("<bob:"):
            base[key] = bob[item[5:-1]]

    def fill(match: re.Match[str]) -> str:
        param = match.group(1)
        if where == "path" and param == name:
            return value
        return bob["checkpoint_id" if param == "checkpoint_id" else param]

    url = re.sub(r"\{(\w+)\}", fill, path).removeprefix("/v1")
    params = {name: value} if where == "query" else None
    body = {**base, name: value} if where == "body" else base
    headers = {"Idempotency-Key": uuid.uuid4().hex}
    send = None if method == "get" else body
    return http.request(method, url, params=params, json=send, headers=headers)


def test_every_slot_of_every_route_answers_another_users_object_as_a_missing_one(
    live: Any, users: dict[str, httpx.Client], work: dict[str, dict[str, str]]
) -> None:
    server, _, roots = live
    bob = users["bob"]
    schema = users["root"].get("/openapi.json").json()
    walked: set[tuple[str, str, str]] = set()
    for path, methods in schema["paths"].items():
        if not path.startswith("/v1/rl/") or "/payloads/{session_id}/" in path:
            continue  # the signed routes: test_signed_routes_check_the_owner_of_their_object
        if path.startswith("/v1/rl/files/"):
            continue
        for method, operation in methods.items():
            for slot in slots(schema, path, operation):
                for value, missing in values(slot[1], work["alice"], server.storage, roots):
                    theirs = _request(bob, method, path, slot, value, work["bob"])
                    nothing = _request(bob, method, path, slot, missing, work["bob"])
                    assert theirs.status_code < 500, (method, path, slot, theirs.text)
                    if slot[0] == "path":  # the object: a missing one's 404 (or its id's 400)
                        ok = theirs.status_code == 404 or (
                            theirs.status_code == 400 and theirs.json()["error"]["param"] == slot[1]
                        )
                        assert ok, (method, path, slot, theirs.text)
                    assert masked(theirs) == masked(nothing), (method, path, slot, value)
                walked.add((method, path, slot[1]))
    assert len(walked) >= 35, sorted(walked)
    assert ("post", "/v1/rl/training-sessions", "resume_from_hf_checkpoint") in walked
    assert ("get", "/v1/rl/model-resources", "after") in walked


def test_signed_routes_check_the_owner_of_their_object(
    live: Any, users: dict[str, httpx.Client], work: dict[str, dict[str, str]]
) -> None:
    """A signed URL is bound to its path and to the user it was issued to: bob's URL with
    alice's ids is refused like one with missing ids."""
    bob, ids = users["bob"], work["bob"]
    upload = bob.post(f"/rl/training-sessions/{ids['session_id']}/payloads/upload-url").json()
    (entry, *_) = bob.get(f"/rl/checkpoints/{ids['checkpoint_id']}/download").json()["data"]
    for url, method in ((upload["upload_url"], "PUT"), (entry["url"], "GET")):
        for kind in ("session_id", "payload_id", "checkpoint_id"):
            if ids[kind] not in url:
                continue
            theirs = httpx.request(method, url.replace(ids[kind], work["alice"][kind]))
            nothing = httpx.request(method, url.replace(ids[kind], fresh(ids[kind])))
            assert theirs.status_code in (403, 404), theirs.text
            assert masked(theirs) == masked(nothing), (method, kind)


def test_a_signed_url_works_only_for_its_users_own_object(
    live: Any, users: dict[str, httpx.Client], work: dict[str, dict[str, str]]
) -> None:
    """Even a valid signature (a URL issued to bob for alice's object, as a bug elsewhere might
    issue one) goes through the ownership check: the 404 of a missing object."""
    server, _, _ = live
    signer, base = server.app.state.signer, server.url
    alice = work["alice"]
    for method, path in (
        ("GET", f"/v1/rl/payloads/{alice['session_id']}/{alice['payload_id']}"),
        ("PUT", f"/v1/rl/payloads/{alice['session_id']}/{alice['payload_id']}"),
        ("GET", f"/v1/rl/files/checkpoints/{alice['checkpoint_id']}/ADAPTER/adapter_config.json"),
    ):
        theirs = httpx.request(method, signer.sign(base, method, path, user="bob"), content=b"{}")
        gone = httpx.request(method, signer.sign(base, method, fresh(path), user="bob"))
        assert theirs.status_code == 404, (path, theirs.text)
        assert masked(theirs) == masked(gone), path
        mine = httpx.request(method, signer.sign(base, method, path, user="alice"), content=b"{}")
        assert mine.status_code == 200, (path, mine.text)


def test_every_mounted_route_is_walked(live: Any, users: dict[str, httpx.Client]) -> None:
    """A route of a face that no walk covers (a third face, say) fails here until it is."""
    server, _, _ = live
    schema = set(users["root"].get("/openapi.json").json()["paths"])
    for _, path in mounted_routes(server.app.router.routes):
        covered = path in schema and path.startswith("/v1/rl/")
        faces = (TINKER_PREFIX, FIREWORKS_PREFIX, HOT_LOAD, SERVERLESS, *COMPLETIONS)
        other_face = path.startswith(faces)
        assert covered or other_face or path in NO_OBJECT, path
