"""Deployments and hot-load over raw HTTP: CRUD and its errors, accounts kept apart, the
hot-load identity rules, a load in flight (425) and a failed one (stage error, the old weights
still served), and a restart (READY again, re-hot-loaded to the last identity).

Two users, alice and bob (`test_control_plane.write_keys`); their sampler snapshots come from
the Fireworks SDK (`sdk_scripts/dep_save.py`), what a deployment serves from the completions
resolver (`face.targets`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.conftest import LiveServer, serve_in_thread
from tests.fireworks.conftest import LLAMA, QWEN
from tests.fireworks.test_control_plane import KEYS, error, write_keys
from tests.fireworks.test_data_plane import close
from tests.fireworks.test_deployments_sdk import HOT_LOAD, deployment_logprobs, save
from tests.tinker import tinker_http as th
from trainer.api.fireworks import hotload
from trainer.api.tinker.records import TinkerCheckpoint
from trainer.serving.errors import ApiError
from trainer.serving.tenants import Principal

pytestmark = pytest.mark.fireworks

ALICE, BOB = Principal("alice"), Principal("bob")
BODY = {  # what `_build_deployment_body` sends (shape path)
    "baseModel": QWEN,
    "description": "Fireworks training deployment",
    "minReplicaCount": 0,
    "maxReplicaCount": 1,
    "enableHotLoad": True,
    "forTraining": False,
    "hotLoadBucketType": "FW_HOSTED",
    "deploymentShape": "local",
}


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dep-keys") / "keys.toml"
    write_keys(path)
    return path


@pytest.fixture(scope="module")
def storage(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("deployments")


@pytest.fixture(scope="module")
def live(fw_models: dict[str, Path], storage: Path, keys: Path) -> Iterator[LiveServer]:
    from trainer.api.keys import KeyRing

    with serve_in_thread(storage, fw_models, keys=KeyRing(keys)) as server:
        yield server


def client(live: LiveServer, name: str) -> httpx.Client:
    return httpx.Client(base_url=live.url, headers={"X-Api-Key": KEYS[name]}, timeout=120)


def create(c: httpx.Client, account: str, dep: str, **body: Any) -> httpx.Response:
    return c.post(
        f"/v1/accounts/{account}/deployments",
        params={"deploymentId": dep, "skipShapeValidation": "true"},
        json={**BODY, **body},
    )


def hot_load(c: httpx.Client, account: str, dep: str, identity: str) -> httpx.Response:
    headers = {"fireworks-deployment": f"accounts/{account}/deployments/{dep}"}
    return c.post(HOT_LOAD, headers=headers, json={"identity": identity})


def status(c: httpx.Client, account: str, dep: str) -> httpx.Response:
    return c.get(
        HOT_LOAD, headers={"fireworks-deployment": f"accounts/{account}/deployments/{dep}"}
    )


def settled(c: httpx.Client, account: str, dep: str, timeout: float = 120) -> dict[str, Any]:
    """The first replica once no load is in flight."""
    deadline = time.monotonic() + timeout
    while True:
        replicas = status(c, account, dep).json()["replicas"]
        if replicas and replicas[0]["loading_state"]["stage"] != "loading":
            found: dict[str, Any] = replicas[0]
            return found
        assert time.monotonic() < deadline, replicas
        time.sleep(0.2)


@pytest.fixture(scope="module")
def snapshots(fw_python_latest: Path, live: LiveServer) -> dict[str, dict[str, Any]]:
    """alice's LoRA snapshots of QWEN (two) and of LLAMA, bob's of QWEN."""
    out = {}
    for label, user, model in (
        ("a1", "alice", QWEN),
        ("a2", "alice", QWEN),
        ("llama", "alice", LLAMA),
        ("b1", "bob", QWEN),
    ):
        server = LiveServer(live.url, KEYS[user], live.worker, live.app, live.storage)
        out[label] = save(fw_python_latest, server, model, 4, f"snap-{label}")
    return out


def test_crud_and_its_errors(live: LiveServer) -> None:
    a, b = client(live, "alice"), client(live, "bob")
    r = create(a, "alice", "crud", annotations={"k": "v"}, placement={"region": "US_OHIO_1"})
    assert r.status_code == 200, r.text
    made = r.json()
    assert made["name"] == "accounts/alice/deployments/crud" and made["state"] == "READY"
    assert made["baseModel"] == QWEN and made["deploymentShape"] == "local"
    assert made["annotations"] == {"k": "v"} and made["placement"] == {"region": "US_OHIO_1"}
    assert made["replicaCount"] == 1 and made["hotLoadTransitionType"] == "ASYNC"
    again = create(a, "alice", "crud")
    assert again.status_code == 409 and error(again)["param"] == "deploymentId"
    assert a.get("/v1/accounts/alice/deployments/crud").json()["createTime"] == made["createTime"]
    # bad bodies: a 400 naming the field, never a 5xx
    for body, field in (
        ({"baseModel": "accounts/fireworks/models/nope"}, "baseModel"),
        ({"maxReplicaCount": -1}, "maxReplicaCount"),
        ({"maxReplicaCount": "many"}, "maxReplicaCount"),
        ({"hotLoadTransitionType": "SOMETIMES"}, "hotLoadTransitionType"),
        ({"surprise": 1}, "surprise"),
        ({"hotLoadTrainerJob": "accounts/bob/rlorTrainerJobs/x"}, "hotLoadTrainerJob"),
        ({"placement": {"region": 7}}, "placement.region"),
    ):
        r = create(a, "alice", "bad-one", **body)
        assert r.status_code == 400 and error(r)["param"] == field, (body, r.text)
    for raw in (b"[1]", b"{", b'"x"', b"null"):
        r = a.post("/v1/accounts/alice/deployments", params={"deploymentId": "raw"}, content=raw)
        assert r.status_code == 400, (raw, r.text)
    r = a.post("/v1/accounts/alice/deployments", params={"deploymentId": "Bad_Id"}, json=BODY)
    assert r.status_code == 400 and error(r)["param"] == "deploymentId"
    r = a.post("/v1/accounts/alice/deployments", json=BODY)
    assert r.status_code == 400 and error(r)["param"] == "deploymentId"
    assert a.get("/v1/accounts/alice/deployments/bad-one").status_code == 404
    # another account's deployment answers exactly like a missing one
    for path in ("/v1/accounts/alice/deployments/crud", "/v1/accounts/bob/deployments/crud"):
        r = b.get(path)
        assert r.status_code == 404 and error(r)["param"] == "deploymentId", r.text
    assert b.delete("/v1/accounts/alice/deployments/crud").status_code == 404
    assert b.patch("/v1/accounts/alice/deployments/crud", json={}).status_code == 404
    assert create(b, "alice", "x").status_code == 404
    assert status(b, "alice", "crud").status_code == 404
    # list: pages
    assert create(a, "alice", "crud-2").status_code == 200
    first = a.get("/v1/accounts/alice/deployments", params={"pageSize": 1}).json()
    assert len(first["deployments"]) == 1 and first["nextPageToken"]
    rest = a.get(
        "/v1/accounts/alice/deployments",
        params={"pageSize": 50, "pageToken": first["nextPageToken"]},
    ).json()
    names = [d["name"] for d in first["deployments"] + rest["deployments"]]
    assert {"accounts/alice/deployments/crud", "accounts/alice/deployments/crud-2"} <= set(names)
    assert b.get("/v1/accounts/bob/deployments").json()["deployments"] == []
    # PATCH: the mask picks fields; an unknown path is a 400 naming updateMask
    r = a.patch(
        "/v1/accounts/alice/deployments/crud",
        params={"updateMask": "hot_load_trainer_job,hot_load_transition_type"},
        json={
            "hotLoadTrainerJob": "accounts/alice/rlorTrainerJobs/t1",
            "hotLoadTransitionType": "SYNC",
            "description": "ignored: not in the mask",
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["hotLoadTrainerJob"] == "accounts/alice/rlorTrainerJobs/t1"
    assert r.json()["hotLoadTransitionType"] == "SYNC"
    assert r.json()["description"] == BODY["description"]
    r = a.patch(
        "/v1/accounts/alice/deployments/crud",
        params={"updateMask": "base_model"},
        json={"baseModel": LLAMA},
    )
    assert r.status_code == 400, r.text
    r = a.patch("/v1/accounts/alice/deployments/crud", params={"updateMask": "state"}, json={})
    assert r.status_code == 400 and error(r)["param"] == "updateMask"
    r = a.patch("/v1/accounts/alice/deployments/crud", json={"minReplicaCount": 3})
    assert r.status_code == 400 and error(r)["param"] == "minReplicaCount"
    # scale to zero: READY, no replica, nothing served; back up: serving again
    r = a.patch(
        "/v1/accounts/alice/deployments/crud", json={"minReplicaCount": 0, "maxReplicaCount": 0}
    )
    assert r.status_code == 200 and r.json()["state"] == "READY" and r.json()["replicaCount"] == 0
    assert status(a, "alice", "crud").json() == {"replicas": []}
    face = live.app.state.fireworks
    with pytest.raises(ApiError) as refused:
        face.targets.resolve("accounts/alice/deployments/crud", ALICE)
    assert refused.value.status == 400 and refused.value.param == "model"
    r = a.patch(
        "/v1/accounts/alice/deployments/crud",
        params={"updateMask": "max_replica_count"},
        json={"maxReplicaCount": 1},
    )
    assert r.status_code == 200 and r.json()["replicaCount"] == 1
    target = face.targets.resolve("accounts/alice/deployments/crud", ALICE)
    target.release()
    assert target.base_model == QWEN and target.identity is None
    # DELETE (the SDK's flags), then 404; the resolver says 404 too, for bob as for alice
    r = a.delete(
        "/v1/accounts/alice/deployments/crud", params={"ignoreChecks": "true", "hard": "true"}
    )
    assert r.status_code == 200 and r.json()["state"] == "DELETED"
    assert a.get("/v1/accounts/alice/deployments/crud").status_code == 404
    for who in (ALICE, BOB):
        with pytest.raises(ApiError) as gone:
            face.targets.resolve("accounts/alice/deployments/crud", who)
        assert gone.value.status == 404 and gone.value.param == "model"
    assert face.targets.resolve("accounts/alice/deployments/crud-2", ALICE) is not None
    with pytest.raises(ApiError) as other:
        face.targets.resolve("accounts/alice/deployments/crud-2", BOB)
    assert other.value.status == 404


ROUTES = [
    ("POST", "/v1/accounts/{a}/deployments?deploymentId={d}"),
    ("GET", "/v1/accounts/{a}/deployments"),
    ("GET", "/v1/accounts/{a}/deployments/{d}"),
    ("PATCH", "/v1/accounts/{a}/deployments/{d}"),
    ("DELETE", "/v1/accounts/{a}/deployments/{d}"),
]


def test_another_accounts_deployment_reads_exactly_as_a_missing_one(live: LiveServer) -> None:
    a, b = client(live, "alice"), client(live, "bob")
    assert create(a, "alice", "secret").status_code == 200
    for method, template in ROUTES:
        theirs = b.request(method, template.format(a="alice", d="secret"), json=BODY)
        nobody = b.request(method, template.format(a="nobody-at-all", d="secret"), json=BODY)
        assert theirs.status_code == 404, (template, theirs.text)
        assert theirs.text.replace("alice", "<a>") == nobody.text.replace("nobody-at-all", "<a>")
    for route in (status, lambda c, x, d: hot_load(c, x, d, "alice/run-" + "0" * 32 + "/x")):
        theirs, nobody = route(b, "alice", "secret"), route(b, "nobody-at-all", "secret")
        assert theirs.status_code == nobody.status_code == 404
        assert theirs.text == nobody.text
    assert (
        b.get("/v1/accounts/bob/deployments/secret").text
        == b.get("/v1/accounts/alice/deployments/secret").text
    )
    assert a.get("/v1/accounts/alice/deployments/secret").json()["state"] == "READY"
    assert a.delete("/v1/accounts/alice/deployments/secret").status_code == 200


def test_hot_load_identity_rules(live: LiveServer, snapshots: dict[str, dict[str, Any]]) -> None:
    a = client(live, "alice")
    assert create(a, "alice", "rules").status_code == 200
    # bob's snapshot, a missing one and a malformed one
    for identity, code in (
        (snapshots["b1"]["identity"], 404),
        ("alice/run-" + "0" * 32 + "/never-saved", 404),
        ("bob/run-" + "0" * 32 + "/never-saved", 404),
        ("not a path", 400),
        ("tinker://nope/sampler_weights/x", 404),
    ):
        r = hot_load(a, "alice", "rules", identity)
        assert r.status_code == code and error(r)["param"] == "identity", (identity, r.text)
    # a snapshot of another base model
    r = hot_load(a, "alice", "rules", snapshots["llama"]["identity"])
    assert r.status_code == 400 and error(r)["param"] == "identity" and LLAMA in error(r)["message"]
    # no or another account's header
    assert a.post(HOT_LOAD, json={"identity": "x"}).status_code == 400
    assert hot_load(a, "bob", "rules", snapshots["a1"]["identity"]).status_code == 404
    r = a.post(
        HOT_LOAD,
        headers={"fireworks-deployment": "accounts/alice/deployments/rules"},
        json={"identity": snapshots["a1"]["identity"], "extra": 1},
    )
    assert r.status_code == 400 and error(r)["param"] == "extra"
    # the delta metadata is accepted (and ignored), a tinker:// sampler path too
    face = live.app.state.fireworks
    saved = face.bridge.db.get(TinkerCheckpoint, snapshots["a1"]["identity"])
    tinker_path = face.bridge.db.select(
        TinkerCheckpoint, "checkpoint_id = ? AND scope IS NULL", (saved.checkpoint_id,)
    )[0].path
    assert tinker_path.startswith("tinker://")
    meta = {
        "previous_snapshot_identity": "x",
        "compression_format": "arc_v2",
        "checksum_format": "alder32",
    }
    r = a.post(
        HOT_LOAD,
        headers={"fireworks-deployment": "accounts/alice/deployments/rules"},
        json={
            "identity": tinker_path,
            "reset_prompt_cache": True,
            "incremental_snapshot_metadata": meta,
        },
    )
    assert r.status_code == 200, r.text
    replica = settled(a, "alice", "rules")
    assert replica["current_snapshot_identity"] == tinker_path and replica["readiness"]


def test_a_load_in_flight_answers_425_and_a_failed_one_keeps_the_old_weights(
    live: LiveServer, snapshots: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    a = client(live, "alice")
    assert create(a, "alice", "flight", maxReplicaCount=2).status_code == 200
    face = live.app.state.fireworks
    name = "accounts/alice/deployments/flight"
    first, second = snapshots["a1"]["identity"], snapshots["a2"]["identity"]
    assert hot_load(a, "alice", "flight", first).status_code == 200
    assert settled(a, "alice", "flight")["current_snapshot_identity"] == first
    _, served = deployment_logprobs(live, name, ALICE)
    assert close(served, snapshots["a1"]["trained"])
    # a load held in flight: 425 naming what it loads, readiness false, stage loading
    deployed = face.deployments.deployed("alice", "flight")
    monkeypatch.setattr(hotload, "SETTLE_S", 0.0)  # the POST answers with the load in flight
    with deployed.opening:
        assert hot_load(a, "alice", "flight", second).status_code == 200
        replicas = status(a, "alice", "flight").json()["replicas"]
        assert len(replicas) == 2
        assert replicas[0]["readiness"] is False
        assert replicas[0]["loading_state"] == {
            "stage": "loading",
            "target_snapshot_identity": second,
        }
        with pytest.raises(ApiError) as early:
            face.targets.resolve(name, ALICE)
        assert early.value.status == 425 and second in early.value.message
    replica = settled(a, "alice", "flight")
    assert replica["current_snapshot_identity"] == second
    assert [x["identity"] for x in replica["loaded_adapters"]] == [second, first]
    # the first snapshot's files go bad underneath: its load fails, the second still serves
    record = face.bridge.db.get(TinkerCheckpoint, first)
    path = live.worker.checkpoints.get(record.checkpoint_id).path
    for file in path.rglob("*.safetensors"):
        file.write_bytes(b"\0" * file.stat().st_size)
    deployed.adapters.clear()  # as if it had been evicted: loading it reads the files again
    assert hot_load(a, "alice", "flight", first).status_code == 200
    replica = settled(a, "alice", "flight")
    assert replica["loading_state"]["stage"] == "error", replica
    assert replica["loading_state"]["target_snapshot_identity"] == first
    assert replica["loading_state"]["error"]
    assert replica["current_snapshot_identity"] == second and replica["readiness"] is True
    identity, served = deployment_logprobs(live, name, ALICE)
    assert identity == second and close(served, snapshots["a2"]["trained"])


def test_deployments_come_back_after_a_restart(
    fw_models: dict[str, Path],
    fw_python_latest: Path,
    keys: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from trainer.api.keys import KeyRing

    storage = tmp_path_factory.mktemp("dep-restart")
    with serve_in_thread(storage, fw_models, keys=KeyRing(keys)) as first:
        a = client(first, "alice")
        assert create(a, "alice", "survivor").status_code == 200
        assert create(a, "alice", "asleep", maxReplicaCount=0).status_code == 200
        server = LiveServer(first.url, KEYS["alice"], first.worker, first.app, first.storage)
        snap = save(fw_python_latest, server, QWEN, 4, "restart")
        assert hot_load(a, "alice", "survivor", snap["identity"]).status_code == 200
        assert settled(a, "alice", "survivor")["current_snapshot_identity"] == snap["identity"]
    with serve_in_thread(storage, fw_models, keys=KeyRing(keys)) as second:
        a = client(second, "alice")
        got = a.get("/v1/accounts/alice/deployments/survivor").json()
        assert got["state"] == "READY", got
        replica = settled(a, "alice", "survivor")
        assert replica["current_snapshot_identity"] == snap["identity"], replica
        assert replica["readiness"] is True
        identity, served = deployment_logprobs(second, "accounts/alice/deployments/survivor", ALICE)
        assert identity == snap["identity"] and close(served, snap["trained"])
        asleep = a.get("/v1/accounts/alice/deployments/asleep").json()
        assert asleep["state"] == "READY" and asleep["replicaCount"] == 0
        assert status(a, "alice", "asleep").json() == {"replicas": []}


def poisoned_snapshot(live: LiveServer, user: str) -> str:
    """A LoRA sampler checkpoint of `user` whose logits are NaN, made with nothing but API
    calls (`tests/tinker/test_nan_neighbour.py`'s way: one step whose decoupled weight decay
    is 1e37 leaves every adapter weight finite but about 1e36): its tinker path."""
    base = f"{live.url}{th.PREFIX}"
    with httpx.Client(base_url=base, headers={"X-API-Key": KEYS[user]}, timeout=120) as http:
        session = th.new_session(http)
        lora = {"rank": 2, "seed": 0}
        body = {"session_id": session, "model_seq_id": 0, "base_model": QWEN, "lora_config": lora}
        model_id = th.ok(http, "/create_model", body)["model_id"]
        data = {"data": [th.datum([3, 17, 22, 9, 27])], "loss_fn": "cross_entropy"}
        th.ok(http, "/forward_backward", {"model_id": model_id, "forward_backward_input": data})
        poison = {"learning_rate": 1.0, "weight_decay": 1e37}
        th.ok(http, "/optim_step", {"model_id": model_id, "adam_params": poison})
        saved = th.ok(http, "/save_weights_for_sampler", {"model_id": model_id, "path": "nan"})
    path: str = saved["path"]
    return path


def same_completion(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> bool:
    """The same tokens, text and finish reasons, and logprobs within 1e-5: a request batched
    with others computes in a batch of another shape, whose float rounding may differ in the
    last bits (the batched logprobs are checked against a reference in test_completions)."""

    def rounded(choices: list[dict[str, Any]]) -> list[Any]:
        out = []
        for c in choices:
            rows = c["logprobs"]["content"]
            numbers = [x for r in rows for x in (r["logprob"], r.get("sampling_logprob"))]
            tokens = [r["token_id"] for r in rows]
            out.append((c["text"], c["finish_reason"], tokens, numbers))
        return out

    for g, w in zip(rounded(got), rounded(want), strict=True):
        if g[:3] != w[:3] or not all(
            (a is None and b is None) or abs(a - b) <= 1e-5 for a, b in zip(g[3], w[3], strict=True)
        ):
            return False
    return len(got) == len(want)


def test_a_nan_neighbour_deployment_fails_alone(
    live: LiveServer, snapshots: dict[str, dict[str, Any]]
) -> None:
    """bob's deployment serves weights whose logits are NaN; his completions fail (422 naming
    `model`) while alice's, sent at the same time on the same base model, answer exactly what
    they answer alone."""
    a, b = client(live, "alice"), client(live, "bob")
    assert create(a, "alice", "calm").status_code == 200
    assert create(b, "bob", "wild").status_code == 200
    calm_snapshot = snapshots["a2"]["identity"]  # a1's files were corrupted by a test above
    assert hot_load(a, "alice", "calm", calm_snapshot).status_code == 200
    assert hot_load(b, "bob", "wild", poisoned_snapshot(live, "bob")).status_code == 200
    assert settled(a, "alice", "calm")["loading_state"]["stage"] == "done"
    assert settled(b, "bob", "wild")["loading_state"]["stage"] == "done"
    body = {"prompt": [3, 17, 22, 9], "max_tokens": 8, "temperature": 1.0, "logprobs": True}
    calm = {**body, "model": "accounts/alice/deployments/calm", "seed": 5}
    wild = {**body, "model": "accounts/bob/deployments/wild"}
    alone = a.post("/inference/v1/completions", json=calm)
    assert alone.status_code == 200, alone.text

    def send(i: int) -> httpx.Response:
        with client(live, "bob" if i % 2 else "alice") as c:
            return c.post("/inference/v1/completions", json=wild if i % 2 else calm)

    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(send, range(6)))
    for i, r in enumerate(answers):
        if i % 2:
            assert r.status_code == 422 and error(r)["param"] == "model", r.text
        else:
            assert r.status_code == 200, r.text
            assert same_completion(r.json()["choices"], alone.json()["choices"])
    assert status(a, "alice", "calm").json()["replicas"][0]["readiness"] is True
