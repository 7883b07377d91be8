"""The Fireworks control plane over raw HTTP: accounts, RLOR trainer jobs (states, errors,
restart), models and training shapes, the per-job gateway, tenants, quotas, audit, metrics.

Three users: alice and bob (bob has `max_resources = 1`), and root (an admin, for the audit
trail and /metrics). The catalogue also has a model whose files do not exist, to see a load
fail.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.conftest import LiveServer, serve_in_thread
from tests.fireworks.conftest import LLAMA, QWEN
from trainer.api.keys import KeyRing

pytestmark = pytest.mark.fireworks

KEYS = {name: secrets.token_urlsafe(24) for name in ("alice", "bob", "root")}
BROKEN = "accounts/fireworks/models/broken"


def write_keys(path: Path) -> KeyRing:
    text = ""
    for name, key in KEYS.items():
        text += f'[[key]]\nuser = "{name}"\nsha256 = "{hashlib.sha256(key.encode()).hexdigest()}"\n'
        text += f"admin = {str(name == 'root').lower()}\n"
        if name == "bob":
            text += "[key.quotas]\nmax_resources = 1\n"
        text += "\n"
    path.write_text(text)
    return KeyRing(path)


@pytest.fixture(scope="module")
def storage(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fw-control-plane")


@pytest.fixture(scope="module")
def served(fw_models: dict[str, Path]) -> dict[str, Path]:
    return {**fw_models, BROKEN: Path("/nonexistent/fireworks-model")}


@pytest.fixture(scope="module")
def live(
    served: dict[str, Path], storage: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    ring = write_keys(tmp_path_factory.mktemp("fw-keys") / "keys.toml")
    with serve_in_thread(storage, served, keys=ring) as server:
        yield server


def client(live: LiveServer, name: str, bearer: bool = False) -> httpx.Client:
    key = KEYS[name]
    headers = {"Authorization": f"Bearer {key}"} if bearer else {"X-Api-Key": key}
    return httpx.Client(base_url=live.url, headers=headers, timeout=120)


def sdk_body(base: str = QWEN, rank: int = 8, **extra: Any) -> dict[str, Any]:
    """What `TrainerJobManager._build_trainer_create_payload` sends (manual path)."""
    config = {"baseModel": base, "loraRank": rank, "learningRate": 1e-5, "region": "US_OHIO_1"}
    return {
        "serviceMode": True,
        "keepAlive": False,
        "dataset": "",
        "trainingConfig": config,
        "useReservation": False,
        "nodeCount": 1,
        **extra,
    }


def create(c: httpx.Client, account: str, job_id: str, body: dict[str, Any]) -> httpx.Response:
    return c.post(
        f"/v1/accounts/{account}/rlorTrainerJobs",
        params={"skipValidations": "true", "rlorTrainerJobId": job_id},
        json=body,
    )


def healthz(c: httpx.Client, account: str, job_id: str) -> httpx.Response:
    return c.get(f"/training/v1/rlorTrainerJobs/{account}/{job_id}/api/v1/healthz")


def error(r: httpx.Response) -> dict[str, Any]:
    found: dict[str, Any] = r.json()["error"]
    return found


def test_accounts_is_exactly_the_callers(live: LiveServer) -> None:
    for bearer in (False, True):
        r = client(live, "alice", bearer).get("/v1/accounts", params={"pageSize": 2})
        assert r.status_code == 200, r.text
        assert r.json()["accounts"] == [{"name": "accounts/alice"}]
    assert httpx.get(f"{live.url}/v1/accounts").status_code == 401
    bad = httpx.get(f"{live.url}/v1/accounts", headers={"X-Api-Key": "nope"})
    assert bad.status_code == 401 and error(bad)["code"] == "invalid_api_key"


def test_a_lora_job_runs_at_once_and_its_gateway_answers(live: LiveServer) -> None:
    c = client(live, "alice")
    r = create(c, "alice", "lora-one", sdk_body(displayName="one"))
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["name"] == "accounts/alice/rlorTrainerJobs/lora-one"
    assert job["state"] == "JOB_STATE_RUNNING"  # a tiny model loads within the POST
    assert job["trainingConfig"]["maxContextLength"] > 0
    assert job["trainingConfig"]["loraRank"] == 8 and job["serviceMode"] is True
    assert job["trainingConfig"]["region"] == "US_OHIO_1" and job["displayName"] == "one"
    assert set(job["acceleratorSeconds"]) == {"CPU"}
    # the id exists: 409, and the SDK then GETs and reuses it
    again = create(c, "alice", "lora-one", sdk_body())
    assert again.status_code == 409 and error(again)["param"] == "rlorTrainerJobId"
    got = c.get("/v1/accounts/alice/rlorTrainerJobs/lora-one").json()
    assert got["state"] == "JOB_STATE_RUNNING" and got["createTime"] == job["createTime"]
    # the gateway: both headers, 200 while RUNNING
    assert healthz(c, "alice", "lora-one").status_code == 200
    assert healthz(client(live, "alice", bearer=True), "alice", "lora-one").status_code == 200
    listed = c.get(
        "/v1/accounts/alice/rlorTrainerJobs", params={"filter": 'state="JOB_STATE_RUNNING"'}
    ).json()
    assert "accounts/alice/rlorTrainerJobs/lora-one" in [
        j["name"] for j in listed["rlorTrainerJobs"]
    ]
    # the job is a model resource of alice's, full weights off, on the job's base model
    resource = live.worker.resource(
        live.app.state.fireworks.records.job("alice", "lora-one").resource_id
    )
    assert resource.owner == "alice" and resource.spec["lora_enabled"] is True
    assert resource.spec["base_model"] == QWEN


def test_delete_cancels_and_resume_loads_again(live: LiveServer) -> None:
    c = client(live, "alice")
    assert create(c, "alice", "full-one", sdk_body(LLAMA, rank=0)).json()["state"] == (
        "JOB_STATE_RUNNING"
    )
    job = live.app.state.fireworks.records.job("alice", "full-one")
    assert live.worker.resource(job.resource_id).spec["lora_enabled"] is False
    gone = c.delete("/v1/accounts/alice/rlorTrainerJobs/full-one")
    assert gone.status_code == 200 and gone.json()["state"] == "JOB_STATE_CANCELLED"
    assert live.worker.resources.get_live(job.resource_id) is None
    shut = healthz(c, "alice", "full-one")
    assert shut.status_code == 400 and "JOB_STATE_CANCELLED" in error(shut)["message"]
    back = c.post("/v1/accounts/alice/rlorTrainerJobs/full-one:resume")
    assert back.status_code == 200, back.text
    assert back.json()["state"] == "JOB_STATE_RUNNING"
    assert healthz(c, "alice", "full-one").status_code == 200
    c.delete("/v1/accounts/alice/rlorTrainerJobs/full-one")


def test_a_failed_load_is_failed_with_a_status_and_holds_nothing(live: LiveServer) -> None:
    c = client(live, "alice")
    job = create(c, "alice", "broken-one", sdk_body(BROKEN, rank=0)).json()
    assert job["state"] == "JOB_STATE_FAILED"
    assert "broken" in job["status"]["message"] and job["status"]["code"] == "INTERNAL"
    assert job["statusMessage"] == job["status"]["message"]
    record = live.app.state.fireworks.records.job("alice", "broken-one")
    assert live.worker.resources.get_live(record.resource_id) is None
    assert healthz(c, "alice", "broken-one").status_code == 400


@pytest.mark.parametrize(
    ("change", "param"),
    [
        (
            {"trainingConfig": {"baseModel": "accounts/fireworks/models/nope"}},
            "trainingConfig.baseModel",
        ),
        ({"trainingConfig": {"baseModel": QWEN, "loraRank": "eight"}}, "trainingConfig.loraRank"),
        ({"trainingConfig": {"baseModel": QWEN, "loraRank": 100000}}, "trainingConfig.loraRank"),
        (
            {"trainingConfig": {"baseModel": QWEN, "maxContextLength": 1 << 30}},
            "trainingConfig.maxContextLength",
        ),
        ({"trainingConfig": {"baseModel": QWEN, "bogus": 1}}, "trainingConfig.bogus"),
        (
            {"trainingConfig": {"baseModel": QWEN, "projectionHeadDim": 64}},
            "trainingConfig.projectionHeadDim",
        ),
        ({"nodeCount": "two"}, "nodeCount"),
        ({"inactivityTimeout": "30m"}, "inactivityTimeout"),
        ({"forwardOnly": "yes please"}, "forwardOnly"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(
    live: LiveServer, change: dict[str, Any], param: str
) -> None:
    r = create(client(live, "alice"), "alice", "bad-input", {**sdk_body(), **change})
    assert r.status_code == 400, r.text
    assert error(r)["param"] == param, r.text
    assert (
        client(live, "alice").get("/v1/accounts/alice/rlorTrainerJobs/bad-input").status_code == 404
    )


def test_bad_ids_and_queries_are_400s(live: LiveServer) -> None:
    c = client(live, "alice")
    assert error(create(c, "alice", "Bad_ID", sdk_body()))["param"] == "rlorTrainerJobId"
    listing = "/v1/accounts/alice/rlorTrainerJobs"
    assert error(c.get(listing, params={"filter": "owner=me"}))["param"] == "filter"
    assert error(c.get(listing, params={"pageSize": "-1"}))["param"] == "pageSize"
    assert error(c.get(listing, params={"pageToken": "zz"}))["param"] == "pageToken"
    assert error(c.get(listing, params={"orderBy": "name"}))["param"] == "orderBy"
    bad_json = c.post(
        "/v1/accounts/alice/rlorTrainerJobs",
        content=b"{not json",
        headers={"Content-Type": "application/json"},
    )
    assert bad_json.status_code == 400 and error(bad_json)["param"] == "body"


WALKED = [
    ("GET", "/v1/accounts/{a}/rlorTrainerJobs/{j}"),
    ("DELETE", "/v1/accounts/{a}/rlorTrainerJobs/{j}"),
    ("POST", "/v1/accounts/{a}/rlorTrainerJobs/{j}:resume"),
    ("GET", "/v1/accounts/{a}/rlorTrainerJobs/{j}/checkpoints"),
    ("GET", "/v1/accounts/{a}/rlorTrainerJobs"),
    ("POST", "/v1/accounts/{a}/rlorTrainerJobs"),
    ("GET", "/v1/accounts/{a}"),
    ("GET", "/v1/accounts/{a}/models/{j}"),
    ("POST", "/v1/accounts/{a}/checkpoints/{j}:promote"),
    ("GET", "/v1/accounts/{a}/trainingShapes/{j}/versions"),
    ("GET", "/v1/accounts/{a}/trainingShapes/{j}/versions/{j}"),
    ("GET", "/training/v1/rlorTrainerJobs/{a}/{j}/api/v1/healthz"),
    ("POST", "/training/v1/rlorTrainerJobs/{a}/{j}/api/v1/create_model"),
    ("GET", "/v1/accounts/{a}/deployments/{j}"),
    ("PATCH", "/v1/accounts/{a}/deployments/{j}"),
    ("DELETE", "/v1/accounts/{a}/deployments/{j}"),
    ("GET", "/v1/accounts/{a}/deployments"),
    ("POST", "/v1/accounts/{a}/deployments"),
    # a serverless training session (tests/fireworks/test_serverless.py drives them)
    ("GET", "/v1/accounts/{a}/trainingSessions/{j}/checkpoints"),
    ("POST", "/v1/accounts/{a}/trainingSessions/{j}/checkpoints/{j}:promote"),
    ("DELETE", "/v1/accounts/{a}/trainingSessions/{j}"),
]
NO_OBJECT = {"/v1/accounts"}  # the caller's own account, whatever the key


def test_every_route_of_the_face_is_walked(live: LiveServer) -> None:
    from trainer.api.audit import mounted_routes

    walked = {template.replace("{a}", "{account}").replace("{j}", "*") for _, template in WALKED}
    for _, path in mounted_routes(live.app.router.routes):
        if not path.startswith("/v1/accounts") or path in NO_OBJECT:
            continue
        shape = path
        for name in (
            "{job_id}",
            "{model}",
            "{checkpoint}",
            "{shape}",
            "{version}",
            "{deployment_id}",
            "{session_id}",
        ):
            shape = shape.replace(name, "*")
        assert shape in walked, path


def test_another_accounts_objects_answer_as_missing_ones(live: LiveServer) -> None:
    alice, bob = client(live, "alice"), client(live, "bob")
    assert create(alice, "alice", "secret", sdk_body()).json()["state"] == "JOB_STATE_RUNNING"
    for method, template in WALKED:
        theirs = bob.request(method, template.format(a="alice", j="secret"), json={})
        nobody = bob.request(method, template.format(a="nobody-at-all", j="secret"), json={})
        assert theirs.status_code == 404, (template, theirs.text)
        shown = theirs.text.replace("alice", "<a>")
        assert shown == nobody.text.replace("nobody-at-all", "<a>"), template
    # bob's own missing job reads the same as alice's real one through the gateway
    mine = bob.get("/training/v1/rlorTrainerJobs/bob/secret/api/v1/healthz")
    assert mine.json() == bob.get("/training/v1/rlorTrainerJobs/alice/secret/api/v1/healthz").json()
    promote = bob.post(
        "/v1/accounts/bob/checkpoints/x:promote",
        json={
            "output_model": "accounts/bob/models/stolen",
            "trainer_job_id": "accounts/bob/rlorTrainerJobs/secret",
            "base_model": QWEN,
        },
    )
    assert promote.status_code == 404 and error(promote)["param"] == "rlorTrainerJobId"
    assert live.app.state.fireworks.records.job("alice", "secret").state == "JOB_STATE_RUNNING"
    alice.delete("/v1/accounts/alice/rlorTrainerJobs/secret")


def test_jobs_count_against_the_resource_quota(live: LiveServer) -> None:
    bob = client(live, "bob")
    assert create(bob, "bob", "first", sdk_body()).json()["state"] == "JOB_STATE_RUNNING"
    second = create(bob, "bob", "second", sdk_body())
    assert second.status_code == 429 and error(second)["param"] == "max_resources"
    assert bob.get("/v1/accounts/bob/rlorTrainerJobs/second").status_code == 404  # no half job
    bob.delete("/v1/accounts/bob/rlorTrainerJobs/first")
    assert create(bob, "bob", "second", sdk_body()).json()["state"] == "JOB_STATE_RUNNING"
    bob.delete("/v1/accounts/bob/rlorTrainerJobs/second")


def test_models_and_training_shapes_come_from_the_catalogue(live: LiveServer) -> None:
    c = client(live, "alice")
    model = c.get(f"/v1/{QWEN}").json()
    assert model["name"] == QWEN and model["baseModelDetails"]["moe"] is False
    assert c.get("/v1/accounts/fireworks/models/nope").status_code == 404
    shape = "accounts/fireworks/trainingShapes/qwen3-tiny-lora"
    versions = c.get(
        f"/v1/{shape}/versions", params={"filter": "latest_validated=true", "pageSize": 1}
    ).json()["trainingShapeVersions"]
    snapshot = versions[0]["snapshot"]
    assert snapshot["trainerMode"] == "LORA_TRAINER" and snapshot["nodeCount"] == 1
    assert snapshot["maxSupportedContextLength"] == model["contextLength"]
    exact = c.get(f"/v1/{versions[0]['name']}")
    assert exact.status_code == 200 and exact.json() == versions[0]
    assert c.get("/v1/accounts/fireworks/trainingShapes/nope/versions").status_code == 404


def test_mutations_are_audited_and_jobs_show_in_metrics(live: LiveServer) -> None:
    c = client(live, "alice")
    create(c, "alice", "audited", sdk_body())
    root = {"Authorization": f"Bearer {KEYS['root']}"}
    lines = httpx.get(f"{live.url}/v1/rl/audit", headers=root, params={"user": "alice"}).json()
    routes = {(x["method"], x["route"]) for x in lines["data"]}
    assert ("POST", "/v1/accounts/{account}/rlorTrainerJobs") in routes
    text = httpx.get(f"{live.url}/metrics", headers=root).text
    assert 'trainer_resources{user="alice"}' in text
    c.delete("/v1/accounts/alice/rlorTrainerJobs/audited")
    lines = httpx.get(f"{live.url}/v1/rl/audit", headers=root, params={"user": "alice"}).json()
    assert lines["data"][0]["route"] == "/v1/accounts/{account}/rlorTrainerJobs/{job_id}"


def test_a_restart_keeps_jobs_paused_and_resume_runs_them(
    served: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    storage = tmp_path_factory.mktemp("fw-restart")
    ring = write_keys(tmp_path_factory.mktemp("fw-restart-keys") / "keys.toml")
    with serve_in_thread(storage, served, keys=ring) as first:
        c = client(first, "alice")
        assert create(c, "alice", "survivor", sdk_body()).json()["state"] == "JOB_STATE_RUNNING"
    with serve_in_thread(storage, served, keys=ring) as second:
        c = client(second, "alice")
        job = c.get("/v1/accounts/alice/rlorTrainerJobs/survivor").json()
        assert job["state"] == "JOB_STATE_PAUSED" and ":resume" in job["status"]["message"]
        assert healthz(c, "alice", "survivor").status_code == 400
        back = c.post("/v1/accounts/alice/rlorTrainerJobs/survivor:resume").json()
        assert back["state"] == "JOB_STATE_RUNNING"
        assert healthz(c, "alice", "survivor").status_code == 200


def test_forward_only_and_the_inactivity_timeout_reach_the_resource(live: LiveServer) -> None:
    c = client(live, "alice")
    body = sdk_body(rank=0, forwardOnly=True, inactivityTimeout="1800s", extraValues={"a": "b"})
    job = create(c, "alice", "reference", body).json()
    assert job["forwardOnly"] is True and job["extraValues"] == {"a": "b"}
    face = live.app.state.fireworks
    record = face.records.job("alice", "reference")
    binding = face.jobs.binding(record)
    assert binding.forward_only is True and binding.lora_rank == 0
    assert binding.resource_id == record.resource_id and binding.base_model == QWEN
    assert live.worker.resource(record.resource_id).spec["inactive_timeout"] == 1800
    c.delete("/v1/accounts/alice/rlorTrainerJobs/reference")
