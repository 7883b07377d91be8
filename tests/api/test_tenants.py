"""Tenants on the RL session API: users with their own keys (a keys file), their own work, and
quotas. Two users and an admin share one worker:

- (the walk of every route, every id-like slot, with user A's ids for user B, is
  `tests/api/test_isolation.py`);
- listings show the caller's own objects (an admin's everyone's, filterable by user), and the
  query filters naming another user's objects come back empty;
- a shared LoRA resource hosts both users' sessions; the other is a 404;
- quotas hold under 16 racing creates and are released when the objects stop; a checkpoint
  or payload past the storage quota is undone;
- a revoked key is refused once the keys file is read again.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.conftest import LiveServer, serve_in_thread
from tests.faults.procs import CE, ce_sample, new_resource, new_session, output, run_op
from trainer.api.keys import KeyRing, KeysFileError, parse_keys
from trainer.api.server import StartupError, resolve_keys
from trainer.serving.config import ServeConfig

KEYS = {name: secrets.token_urlsafe(24) for name in ("alice", "alice2", "bob", "root")}


def keys_toml(*, drop: tuple[str, ...] = (), alice_quotas: str = "") -> str:
    def entry(name: str, user: str, admin: bool = False, quotas: str = "") -> str:
        if name in drop:
            return ""
        digest = hashlib.sha256(KEYS[name].encode()).hexdigest()
        text = f'[[key]]\nuser = "{user}"\nsha256 = "{digest}"\nadmin = {str(admin).lower()}\n'
        return text + (f"[key.quotas]\n{quotas}\n" if quotas else "") + "\n"

    quotas = alice_quotas or "max_resources = 2\nmax_sessions = 3"
    return (
        entry("alice", "alice", quotas=quotas)
        + entry("alice2", "alice", quotas=quotas)
        + entry("bob", "bob")
        + entry("root", "root", admin=True)
    )


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    path.write_text(keys_toml())
    return path


@pytest.fixture(scope="module")
def live(
    tiny_qwen_dir: Path, keys_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    storage = tmp_path_factory.mktemp("tenants")
    models = {"tiny-qwen": tiny_qwen_dir}
    with serve_in_thread(storage, models, keys=KeyRing(keys_file)) as server:
        yield server


def client(live: LiveServer, name: str) -> httpx.Client:
    return live.client(KEYS[name])


@pytest.fixture(scope="module")
def alice(live: LiveServer) -> Iterator[httpx.Client]:
    with client(live, "alice") as http:
        yield http


@pytest.fixture(scope="module")
def bob(live: LiveServer) -> Iterator[httpx.Client]:
    with client(live, "bob") as http:
        yield http


@pytest.fixture(scope="module")
def root(live: LiveServer) -> Iterator[httpx.Client]:
    with client(live, "root") as http:
        yield http


@pytest.fixture(scope="module")
def work(alice: httpx.Client) -> dict[str, str]:
    """Alice's objects: a resource, a session, an operation, checkpoints and a payload."""
    rid = new_resource(alice, "tiny-qwen")
    sid = new_session(alice, rid, lora_config={"rank": 4, "seed": 0})
    op = run_op(alice, sid, "forward-backward", {"loss": CE, "samples": [ce_sample([1, 2, 3])]})
    training = output(alice, sid, "training-checkpoint")["checkpoint"]["id"]
    inference = output(alice, sid, "inference-checkpoint")["checkpoint"]["id"]
    upload = alice.post(f"/rl/training-sessions/{sid}/payloads/upload-url").json()
    put = httpx.put(upload["upload_url"], content=b'{"samples": []}')
    assert put.status_code == 200, put.text
    return {
        "model_resources_id": rid,
        "session_id": sid,
        "operation_id": op["id"],
        "checkpoint_id": inference,
        "training_checkpoint_id": training,
        "payload_id": upload["payload_id"],
    }


# --------------------------------------------------------------------------------------------
# The keys file
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "line", "says"),
    [
        ('[[key]]\nuser = "a"\nsha256 = "abc"\n', 1, "sha256 must be 64 hex digits"),
        (
            f'[[key]]\nuser = "a"\nsha256 = "{"0" * 64}"\n\n[[key]]\nuser = "b c"\n'
            f'sha256 = "{"1" * 64}"\n',
            5,
            "user must be",
        ),
        (f'[[key]]\nuser = "a"\nsha256 = "{"0" * 64}"\nadmin = "yes"\n', 1, "admin must be"),
        (
            f'[[key]]\nuser = "a"\nsha256 = "{"0" * 64}"\n[key.quotas]\nmax_gpus = 1\n',
            1,
            "quotas.max_gpus is not a quota",
        ),
        (
            f'[[key]]\nuser = "a"\nsha256 = "{"0" * 64}"\n\n[[key]]\nuser = "b"\n'
            f'sha256 = "{"0" * 64}"\n',
            5,
            "the same sha256 as the [[key]] at line 1",
        ),
        ('[[key]]\nuser = "a"\nsha256 = \n', 3, ""),  # TOML itself: its own line
    ],
)
def test_a_malformed_keys_file_names_the_line(text: str, line: int, says: str) -> None:
    with pytest.raises(KeysFileError) as info:
        parse_keys(text, "keys.toml")
    assert f"line {line}" in str(info.value) and says in str(info.value)


def test_a_malformed_keys_file_stops_the_start(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    path.write_text('[[key]]\nuser = "a"\nsha256 = "nothex"\n')
    config = ServeConfig.model_validate({"storage": tmp_path, "keys_file": path, "model": []})
    with pytest.raises(StartupError, match=r"--keys .*line 1.*sha256"):
        resolve_keys(config, {})


def test_keys_are_stored_as_digests_and_identify_their_user(keys_file: Path) -> None:
    ring = KeyRing(keys_file)
    text = keys_file.read_text()
    assert all(key not in text for key in KEYS.values())
    alice, again, bob = (ring.identify(KEYS[n]) for n in ("alice", "alice2", "bob"))
    assert alice is not None and again == alice and alice.user == "alice" and not alice.admin
    assert bob is not None and bob.user == "bob"
    assert ring.identify(KEYS["alice"] + "x") is None and ring.identify("") is None
    root = ring.identify(KEYS["root"])
    assert root is not None and root.admin


def test_the_same_key_works_on_both_faces(live: LiveServer) -> None:
    for headers in (
        {"Authorization": f"Bearer {KEYS['bob']}"},
        {"X-API-Key": f"tml-{KEYS['bob']}"},
        {"X-API-Key": KEYS["bob"]},
    ):
        face = "/api/v1/healthz" if "X-API-Key" in headers else "/v1/rl/supported-models"
        assert httpx.get(f"{live.url}{face}", headers=headers).status_code == 200
    refused = httpx.get(f"{live.url}/v1/rl/supported-models", headers={"Authorization": "Bearer x"})
    assert refused.status_code == 401


# --------------------------------------------------------------------------------------------
# Ownership
# --------------------------------------------------------------------------------------------


def test_created_by_is_the_user_and_listings_are_per_user(
    alice: httpx.Client, bob: httpx.Client, root: httpx.Client, work: dict[str, str]
) -> None:
    rid, sid = work["model_resources_id"], work["session_id"]
    assert alice.get(f"/rl/model-resources/{rid}").json()["created_by"] == "alice"
    assert alice.get(f"/rl/training-sessions/{sid}").json()["created_by"] == "alice"
    for path in ("/rl/model-resources", "/rl/training-sessions", "/rl/checkpoints"):
        mine = {item["id"] for item in alice.get(path).json()["data"]}
        assert mine, path
        assert bob.get(path).json()["data"] == [], path
        everyone = {item["id"] for item in root.get(path).json()["data"]}
        assert mine <= everyone, path
    for path in ("/rl/model-resources", "/rl/training-sessions"):
        assert bob.get(path, params={"created_by": "alice"}).json()["data"] == []
        by_alice = root.get(path, params={"created_by": "alice"}).json()["data"]
        assert by_alice and all(item["created_by"] == "alice" for item in by_alice)
        assert root.get(path, params={"created_by": "bob"}).json()["data"] == []
    # query filters naming alice's objects find nothing for bob
    assert bob.get("/rl/checkpoints", params={"session_id": sid}).json()["data"] == []
    listed = bob.get("/rl/training-sessions", params={"model_resources_id": rid}).json()
    assert listed["data"] == []


def test_a_signed_url_fetches_its_own_object_only(
    alice: httpx.Client, bob: httpx.Client, work: dict[str, str]
) -> None:
    """A download URL is bound to the object it was signed for: another object's path under
    its signature is refused, and bob cannot have one signed for alice's checkpoint."""
    (entry, *_) = alice.get(f"/rl/checkpoints/{work['checkpoint_id']}/download").json()["data"]
    assert httpx.get(entry["url"]).status_code == 200
    other = entry["url"].replace(work["checkpoint_id"], f"ck_{uuid.uuid4().hex}")
    assert httpx.get(other).status_code in (401, 403)
    assert bob.get(f"/rl/checkpoints/{work['checkpoint_id']}/download").status_code == 404


def test_references_to_another_users_objects_read_as_missing(
    bob: httpx.Client, work: dict[str, str]
) -> None:
    """Ids in bodies: a session on alice's (unshared) resource, a resume from her checkpoint,
    a resource trained from her merged weights."""

    def same(field: str, body: dict[str, Any], path: str, ident: str) -> None:
        theirs = bob.post(path, json=body)
        fresh = f"xx_{uuid.uuid4().hex}"
        nothing = bob.post(path, json={**body, field: fresh})
        assert theirs.status_code == nothing.status_code, (theirs.text, nothing.text)
        assert theirs.text.replace(ident, "<id>") == nothing.text.replace(fresh, "<id>")

    rid = work["model_resources_id"]
    same("model_resources_id", {"model_resources_id": rid}, "/rl/training-sessions", rid)
    mine = new_resource(bob, "tiny-qwen")
    ckpt = work["training_checkpoint_id"]
    same(
        "resume_from_checkpoint_id",
        {"model_resources_id": mine, "resume_from_checkpoint_id": ckpt},
        "/rl/training-sessions",
        ckpt,
    )
    ref = work["checkpoint_id"]
    body = {"base_model": "tiny-qwen", "lora_enabled": False, "base_weights_ref": ref}
    same("base_weights_ref", body, "/rl/model-resources", ref)
    bob.post(f"/rl/model-resources/{mine}/stop", json={"force": True})


def test_a_shared_resource_hosts_both_users(
    alice: httpx.Client, bob: httpx.Client, live: LiveServer
) -> None:
    rid = new_resource(alice, "tiny-qwen", shared=True)
    assert bob.get(f"/rl/model-resources/{rid}").status_code == 200
    theirs = new_session(bob, rid, lora_config={"rank": 4, "seed": 1})
    own = new_session(alice, rid, lora_config={"rank": 4, "seed": 1})
    assert bob.get(f"/rl/training-sessions/{theirs}").json()["created_by"] == "bob"
    assert bob.get(f"/rl/training-sessions/{own}").status_code == 404  # her session stays hers
    # side by side (one merged pass when they meet), each user's numbers are its solo run's
    body = {"loss": CE, "samples": [ce_sample([3, 4, 5, 6])], "forward_only": True}
    solo = {
        "bob": output(bob, theirs, "forward-backward", body)["loss"],
        "alice": output(alice, own, "forward-backward", body)["loss"],
    }
    results: dict[str, Any] = {}

    def run(name: str, http: httpx.Client, sid: str) -> None:
        results[name] = output(http, sid, "forward-backward", body)["loss"]

    threads = [
        threading.Thread(target=run, args=("bob", bob, theirs)),
        threading.Thread(target=run, args=("alice", alice, own)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name in ("bob", "alice"):  # within the fp32 rounding of a merged pass
        assert results[name] == pytest.approx(solo[name], rel=5e-6)
    stop = bob.post(f"/rl/model-resources/{rid}/stop", json={"force": True})
    assert stop.status_code == 403 and stop.json()["error"]["param"] == "model_resources_id"
    for http, sid in ((bob, theirs), (alice, own)):
        http.post(f"/rl/training-sessions/{sid}/stop")
    alice.post(f"/rl/model-resources/{rid}/stop", json={"force": True})


# --------------------------------------------------------------------------------------------
# Quotas
# --------------------------------------------------------------------------------------------


def _race(n: int, call: Any) -> list[httpx.Response]:
    barrier = threading.Barrier(n)
    out: list[httpx.Response] = []
    lock = threading.Lock()

    def one() -> None:
        barrier.wait()
        response = call()
        with lock:
            out.append(response)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_racing_session_creates_never_pass_the_quota(
    live: LiveServer, alice: httpx.Client, work: dict[str, str]
) -> None:
    """max_sessions = 3, one live already (`work`): of 16 racing creates (both of alice's
    keys), exactly 2 succeed; the rest are 429s naming the quota and the use."""
    rid = new_resource(alice, "tiny-qwen")
    clients = [client(live, "alice" if i % 2 else "alice2") for i in range(16)]
    try:
        answers = _race(
            16,
            lambda: clients[threading.get_ident() % 16].post(
                "/rl/training-sessions", json={"model_resources_id": rid}
            ),
        )
    finally:
        for c in clients:
            c.close()
    made = [r for r in answers if r.status_code == 200]
    refused = [r for r in answers if r.status_code == 429]
    assert len(made) == 2 and len(refused) == 14, [r.text for r in answers]
    error = refused[0].json()["error"]
    assert error["param"] == "max_sessions" and "3 in use of 3" in error["message"]
    # stopping one frees its slot
    alice.post(f"/rl/training-sessions/{made[0].json()['id']}/stop")
    again = alice.post("/rl/training-sessions", json={"model_resources_id": rid})
    assert again.status_code == 200, again.text
    for sid in (made[1].json()["id"], again.json()["id"]):
        alice.post(f"/rl/training-sessions/{sid}/stop")
    alice.post(f"/rl/model-resources/{rid}/stop", json={"force": True})


def test_racing_resource_creates_never_pass_the_quota(
    alice: httpx.Client, work: dict[str, str]
) -> None:
    """max_resources = 2, one live already (`work`): one of 16 racing creates succeeds."""
    answers = _race(16, lambda: alice.post("/rl/model-resources", json={"base_model": "tiny-qwen"}))
    made = [r for r in answers if r.status_code == 200]
    assert len(made) == 1, [r.text for r in answers]
    refused = [r for r in answers if r.status_code == 429]
    assert len(refused) == 15
    assert refused[0].json()["error"]["param"] == "max_resources"
    alice.post(f"/rl/model-resources/{made[0].json()['id']}/stop", json={"force": True})


def test_a_checkpoint_past_the_storage_quota_is_undone(tiny_qwen_dir: Path, tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(keys_toml(alice_quotas="max_storage_bytes = 200000"))
    models = {"tiny-qwen": tiny_qwen_dir}
    with (
        serve_in_thread(tmp_path / "s", models, keys=KeyRing(keys)) as srv,
        client(srv, "alice") as http,
    ):
        rid = new_resource(http, "tiny-qwen", lora_enabled=False)
        sid = new_session(http, rid)
        op = run_op(http, sid, "inference-checkpoint")
        assert op["status"] == "TRAINING_OPERATION_STATUS_FAILED", op
        assert "max_storage_bytes" in op["error"]["message"]
        assert op["error"]["code"].endswith("RESOURCE_EXHAUSTED")
        assert http.get("/rl/checkpoints").json()["data"] == []
        assert srv.worker.storage_used("alice") == 0
        # a payload past it is refused and gone too
        url = http.post(f"/rl/training-sessions/{sid}/payloads/upload-url").json()
        put = httpx.put(url["upload_url"], content=b"x" * 300_000)
        assert put.status_code == 429 and "max_storage_bytes" in put.text
        assert srv.worker.storage_used("alice") == 0


# --------------------------------------------------------------------------------------------
# Revocation
# --------------------------------------------------------------------------------------------


def test_a_revoked_key_is_refused_once_the_file_is_read_again(
    live: LiveServer, keys_file: Path
) -> None:
    """What SIGHUP does (`KeyRing.reload`): alice's second key removed, refused at once; her
    first key still works; a malformed file keeps the keys in force."""
    ring: KeyRing = live.app.state.keys
    with client(live, "alice2") as second, client(live, "alice") as first:
        assert second.get("/rl/supported-models").status_code == 200
        keys_file.write_text(keys_toml(drop=("alice2",)))
        assert ring.reload()
        assert second.get("/rl/supported-models").status_code == 401
        assert first.get("/rl/supported-models").status_code == 200
        keys_file.write_text("[[key]]\nuser = 1\n")
        assert not ring.reload()
        assert first.get("/rl/supported-models").status_code == 200
        keys_file.write_text(keys_toml())
        assert ring.reload()
