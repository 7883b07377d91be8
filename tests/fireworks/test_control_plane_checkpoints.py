"""A job's checkpoints, their promotion to models, and those models in use: listed with the
types the cookbook reads, promoted (a PEFT adapter, or a merged full model), read back with
`GET /v1/{model}`, resolved to a directory for `load_adapter`, and (a full model) trained on
as the base model of a new job. The checkpoints are saved through the RL face on the job's
own resource, so these tests need nothing of the Tinker face's binding."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.conftest import LiveServer, serve_in_thread
from tests.fireworks.conftest import LLAMA, QWEN
from tests.fireworks.test_control_plane import BROKEN, client, create, error, sdk_body, write_keys

pytestmark = pytest.mark.fireworks

TERMINAL = ("TRAINING_OPERATION_STATUS_COMPLETED", "TRAINING_OPERATION_STATUS_FAILED")


@pytest.fixture(scope="module")
def live(
    fw_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    ring = write_keys(tmp_path_factory.mktemp("fw-ckpt-keys") / "keys.toml")
    storage = tmp_path_factory.mktemp("fw-ckpt")
    served = {**fw_models, BROKEN: Path("/nonexistent")}
    with serve_in_thread(storage, served, keys=ring) as server:
        yield server


def rl(live: LiveServer, name: str) -> httpx.Client:
    from tests.fireworks.test_control_plane import KEYS

    headers = {"Authorization": f"Bearer {KEYS[name]}"}
    return httpx.Client(base_url=live.api, headers=headers, timeout=120)


def op(http: httpx.Client, sid: str, kind: str, body: dict[str, Any] | None = None) -> Any:
    url = f"/rl/training-sessions/{sid}/operations/{kind}"
    r = http.post(url, json=body or {}, headers={"Idempotency-Key": str(uuid.uuid4())})
    assert r.status_code == 200, r.text
    found = r.json()
    while found["status"] not in TERMINAL:
        time.sleep(0.05)
        found = http.get(f"{url}/{found['id']}").json()
    assert found["status"] == TERMINAL[0], found
    return found["output"]


def trained_session(live: LiveServer, job_id: str, lora: bool) -> tuple[httpx.Client, str]:
    """A session on the job's resource (alice's), one step trained."""
    http = rl(live, "alice")
    record = live.app.state.fireworks.records.job("alice", job_id)
    body: dict[str, Any] = {"model_resources_id": record.resource_id}
    if lora:
        body["lora_config"] = {"rank": 4, "seed": 0}
    r = http.post("/rl/training-sessions", json=body)
    assert r.status_code == 200, r.text
    sid: str = r.json()["id"]
    tokens = list(range(3, 20))
    sample = {
        "model_input": {"chunks": [{"encoded_text": {"tokens": tokens[:-1]}}]},
        "loss_fn_inputs": {
            "target_tokens": {"data": tokens[1:], "dtype": "int64"},
            "weights": {"data": [1.0] * (len(tokens) - 1), "dtype": "float32"},
        },
    }
    op(
        http,
        sid,
        "forward-backward",
        {"loss": {"type": "LOSS_TYPE_CROSS_ENTROPY"}, "samples": [sample]},
    )
    op(http, sid, "optim-step", {})
    return http, sid


def checkpoints(c: httpx.Client, job_id: str, **params: Any) -> dict[str, Any]:
    r = c.get(f"/v1/accounts/alice/rlorTrainerJobs/{job_id}/checkpoints", params=params)
    assert r.status_code == 200, r.text
    found: dict[str, Any] = r.json()
    return found


def promote(c: httpx.Client, job_id: str, checkpoint: str, model_id: str) -> httpx.Response:
    return c.post(
        f"/v1/accounts/alice/checkpoints/{checkpoint}:promote",
        json={
            "output_model": f"accounts/alice/models/{model_id}",
            "trainer_job_id": f"accounts/alice/rlorTrainerJobs/{job_id}",
            "base_model": QWEN,
            "async_promotion": True,
        },
    )


def test_lora_checkpoints_list_and_promote_to_an_adapter(live: LiveServer) -> None:
    c = client(live, "alice")
    assert create(c, "alice", "lora-ckpt", sdk_body(QWEN, rank=8)).json()["state"] == (
        "JOB_STATE_RUNNING"
    )
    assert checkpoints(c, "lora-ckpt")["checkpoints"] == []
    http, sid = trained_session(live, "lora-ckpt", lora=True)
    training = op(http, sid, "training-checkpoint")["checkpoint"]["id"]
    sampler = op(http, sid, "inference-checkpoint")["checkpoint"]["id"]
    rows = checkpoints(c, "lora-ckpt")["checkpoints"]
    assert [r["name"].split("/")[-1] for r in rows] == [training, sampler]  # oldest first
    assert rows[0]["name"] == f"accounts/alice/rlorTrainerJobs/lora-ckpt/checkpoints/{training}"
    assert [r["checkpointType"] for r in rows] == [
        "CHECKPOINT_TYPE_TRAINING_LORA",  # the cookbook resumes from types ending TRAINING_LORA
        "CHECKPOINT_TYPE_INFERENCE_LORA",
    ]
    assert [r["promotable"] for r in rows] == [False, True]
    assert rows[0]["createTime"].endswith("Z") and rows[0]["createTime"] <= rows[1]["createTime"]
    first = checkpoints(c, "lora-ckpt", pageSize=1)
    second = checkpoints(c, "lora-ckpt", pageSize=1, pageToken=first["nextPageToken"])
    assert first["checkpoints"] + second["checkpoints"] == rows and not second["nextPageToken"]

    refused = promote(c, "lora-ckpt", training, "from-training")
    assert refused.status_code == 400 and error(refused)["param"] == "checkpoint"
    r = promote(c, "lora-ckpt", sampler, "lora-adapter")
    assert r.status_code == 200, r.text
    model = r.json()["model"]
    assert model["name"] == "accounts/alice/models/lora-adapter"
    assert model["kind"] == "HF_PEFT_ADDON" and model["peftDetails"]["r"] == 4
    assert promote(c, "lora-ckpt", sampler, "lora-adapter").status_code == 409
    got = c.get("/v1/accounts/alice/models/lora-adapter").json()
    assert got["state"] == "READY" and got["baseModelDetails"]["moe"] is False
    # load_adapter's resolver: the PEFT directory, for alice only
    catalog = live.app.state.fireworks.catalog
    alice = live.worker.principals("alice")
    assert alice is not None
    adapter = catalog.resolve("accounts/alice/models/lora-adapter", alice)
    assert adapter is not None and (adapter / "adapter_config.json").is_file()
    bob = live.worker.principals("bob")
    assert bob is not None
    assert catalog.resolve("accounts/alice/models/lora-adapter", bob) is None
    # another account's model reads as a missing one
    bob_c = client(live, "bob")
    theirs = bob_c.get("/v1/accounts/alice/models/lora-adapter")
    assert theirs.status_code == 404
    assert theirs.text == bob_c.get("/v1/accounts/alice/models/no-such-model").text.replace(
        "no-such-model", "lora-adapter"
    )
    # an adapter is no base model
    as_base = create(c, "alice", "on-adapter", sdk_body("accounts/alice/models/lora-adapter", 8))
    assert as_base.status_code == 400 and error(as_base)["param"] == "trainingConfig.baseModel"
    # the job deleted: its checkpoints stay listed and promotable
    c.delete("/v1/accounts/alice/rlorTrainerJobs/lora-ckpt")
    assert checkpoints(c, "lora-ckpt")["checkpoints"] == rows


def test_a_promoted_full_model_is_the_base_of_a_new_job(live: LiveServer) -> None:
    c = client(live, "alice")
    assert create(c, "alice", "full-ckpt", sdk_body(LLAMA, rank=0)).json()["state"] == (
        "JOB_STATE_RUNNING"
    )
    http, sid = trained_session(live, "full-ckpt", lora=False)
    sampler = op(http, sid, "inference-checkpoint")["checkpoint"]["id"]
    [row] = checkpoints(c, "full-ckpt")["checkpoints"]
    assert row["checkpointType"] == "CHECKPOINT_TYPE_INFERENCE_BASE" and row["promotable"]
    model = promote(c, "full-ckpt", sampler, "full-model").json()["model"]
    assert model["kind"] == "HF_BASE_MODEL" and "peftDetails" not in model
    alice = live.worker.principals("alice")
    assert alice is not None  # a full model is no adapter: load_adapter does not take it
    assert (
        live.app.state.fireworks.catalog.resolve("accounts/alice/models/full-model", alice) is None
    )
    c.delete("/v1/accounts/alice/rlorTrainerJobs/full-ckpt")
    lora_on_it = create(c, "alice", "on-full", sdk_body("accounts/alice/models/full-model", 8))
    assert error(lora_on_it)["param"] == "trainingConfig.loraRank"
    job = create(c, "alice", "on-full", sdk_body("accounts/alice/models/full-model", 0)).json()
    assert job["state"] == "JOB_STATE_RUNNING", job
    assert job["trainingConfig"]["baseModel"] == "accounts/alice/models/full-model"
    record = live.app.state.fireworks.records.job("alice", "on-full")
    spec = live.worker.resource(record.resource_id).spec
    assert spec["base_weights_ref"] == sampler and spec["base_model"] == LLAMA
    # bob cannot train on alice's model: unknown to him
    other = create(
        client(live, "bob"), "bob", "on-full", sdk_body("accounts/alice/models/full-model", 0)
    )
    assert other.status_code == 400 and error(other)["param"] == "trainingConfig.baseModel"
    c.delete("/v1/accounts/alice/rlorTrainerJobs/on-full")
