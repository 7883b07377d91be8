"""Deployments and hot-load through the Fireworks SDK (`DeploymentManager`, both SDK lines),
and what a deployment serves, checked numerically through the completions resolver
(`face.targets`): the logprobs of its engine session against the trainer's at the save (a
LoRA adapter, full weights) and against plain `transformers` before any hot-load.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.conftest import TOKEN, LiveServer
from tests.fireworks.conftest import QWEN, SCRIPTS, run_fw
from tests.fireworks.test_data_plane import close, reference_logprobs
from trainer.api.tinker import convert
from trainer.serving.catalogue import RES_READY, RES_STOPPED
from trainer.serving.tenants import LOCAL, Principal

pytestmark = pytest.mark.fireworks

SEQS = [[3, 17, 22, 9, 27, 5], [8, 21, 33, 30, 12]]
HOT_LOAD = "/hot_load/v1/models/hot_load"


def save(python: Path, server: LiveServer, model: str, rank: int, name: str) -> dict[str, Any]:
    """A trainer's sampler snapshot: `{identity, trained}` (`sdk_scripts/dep_save.py`)."""
    argv = [str(SCRIPTS / "dep_save.py"), model, str(rank), name, json.dumps(SEQS)]
    return run_fw(python, server, argv, api_key=server.token)


def deployment_logprobs(
    server: LiveServer, name: str, who: Principal = LOCAL
) -> tuple[str | None, list[list[float]]]:
    """(identity, logprobs of `SEQS`) of what the deployment serves, by a forward on the
    engine session its completions would sample (`Targets.resolve`)."""
    face = server.app.state.fireworks
    target = face.targets.resolve(name, who)
    try:
        data = [
            {
                "model_input": {"chunks": [{"type": "encoded_text", "tokens": s[:-1]}]},
                "loss_fn_inputs": {
                    "target_tokens": {"data": s[1:], "dtype": "int64", "shape": [len(s) - 1]},
                    "weights": {
                        "data": [1.0] * (len(s) - 1),
                        "dtype": "float32",
                        "shape": [len(s) - 1],
                    },
                },
            }
            for s in SEQS
        ]
        fbi = {"data": data, "loss_fn": "cross_entropy"}
        body = convert.forward_backward_body(fbi, True)
        bridge = face.bridge
        call = bridge.prepare(target.session_id, "forward-backward", body)
        out = bridge.run(target.session_id, "forward-backward", call, f"t-{uuid.uuid4().hex}")
        result = convert.forward_backward_output(out, "cross_entropy")
        return target.identity, [o["logprobs"].tolist() for o in result["loss_fn_outputs"]]
    finally:
        target.release()


def status(c: httpx.Client, name: str) -> dict[str, Any]:
    r = c.get(HOT_LOAD, headers={"fireworks-deployment": name, "fireworks-model": QWEN})
    assert r.status_code == 200, r.text
    found: dict[str, Any] = r.json()
    return found


def wait_loaded(c: httpx.Client, name: str, identity: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        replicas = status(c, name)["replicas"]
        if (
            replicas
            and replicas[0]["readiness"]
            and (replicas[0]["current_snapshot_identity"] == identity)
        ):
            return replicas[0]
        if replicas and replicas[0]["loading_state"]["stage"] == "error":
            return replicas[0]
        assert time.monotonic() < deadline, replicas
        time.sleep(0.2)


def fw_client(server: LiveServer) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"X-Api-Key": TOKEN}, timeout=120)


def test_the_sdk_creates_hot_loads_patches_scales_and_deletes(
    fw_python: Path, fw_server: LiveServer
) -> None:
    snap = save(fw_python, fw_server, QWEN, 4, "sdk-hot")
    identity = snap["identity"]
    assert identity.startswith("local/run-") and "/sdk-hot" in identity
    dep = f"sdk-{uuid.uuid4().hex[:8]}"
    job = "accounts/local/rlorTrainerJobs/some-trainer"
    out = run_fw(fw_python, fw_server, [str(SCRIPTS / "dep_manage.py"), QWEN, dep, identity, job])
    name = f"accounts/local/deployments/{dep}"
    assert out["created"] == "READY" and out["ready"][:2] == ["READY", name], out
    assert out["ready"][2] in (QWEN, None)  # 1.2.9 reads no baseModel
    assert out["again"] == name
    assert out["get"] == [name, "local", "ASYNC"], out["get"]  # unset: ASYNC
    before = out["before"]["replicas"]
    assert len(before) == 1 and before[0]["readiness"] is True
    assert before[0]["current_snapshot_identity"] is None  # the base model
    assert out["loaded"] is True
    after = out["after"]["replicas"][0]
    assert after["current_snapshot_identity"] == identity
    assert after["loaded_adapters"] == [{"identity": identity, "status": "loaded"}]
    assert after["loading_state"] == {"stage": "done", "target_snapshot_identity": identity}
    assert out["updated"] == "SYNC"
    assert out["attached"] == ["READY", job]
    assert out["zero"] == ["READY", {"replicas": []}]  # no replica serves, nothing held
    assert out["deleted"] is True


@pytest.mark.parametrize("rank", [4, 0])
def test_a_deployment_serves_the_base_then_exactly_the_hot_loaded_weights(
    fw_python_latest: Path, fw_server: LiveServer, fw_models: dict[str, Path], rank: int
) -> None:
    c = fw_client(fw_server)
    dep = f"numerics-{rank}"
    name = f"accounts/local/deployments/{dep}"
    r = c.post(
        "/v1/accounts/local/deployments",
        params={"deploymentId": dep},
        json={"baseModel": QWEN, "deploymentShape": "local", "maxReplicaCount": 2},
    )
    assert r.status_code == 200 and r.json()["state"] == "READY", r.text
    # before any hot-load: the base model exactly
    identity, base = deployment_logprobs(fw_server, name)
    assert identity is None
    assert close(base, reference_logprobs(fw_models[QWEN], SEQS)), base
    snap = save(fw_python_latest, fw_server, QWEN, rank, f"num-{rank}")
    r = c.post(
        HOT_LOAD,
        headers={"fireworks-deployment": name, "fireworks-model": QWEN},
        json={"identity": snap["identity"], "reset_prompt_cache": True},
    )
    assert r.status_code == 200, r.text
    replica = wait_loaded(c, name, snap["identity"])
    assert replica["loading_state"]["stage"] == "done", replica
    assert len(status(c, name)["replicas"]) == 2  # one entry per maxReplicaCount
    served_identity, served = deployment_logprobs(fw_server, name)
    assert served_identity == snap["identity"]
    # the saved weights, though the trainer took another step since
    assert close(served, snap["trained"]), (served, snap["trained"])
    assert not close(served, base)
    face = fw_server.app.state.fireworks
    deployed = face.deployments.deployed("local", dep)
    if rank == 0:  # its own full-weight resource, with the checkpoint's session on it
        assert deployed.full is not None and deployed.full_resource is not None
        resource = fw_server.worker.resource(deployed.full_resource)
        assert resource.spec["lora_enabled"] is False and resource.owner == "local"
        assert replica["loaded_adapters"] == []
        # a LoRA hot-load after full weights serves the adapter and releases that resource
        held = face.targets.resolve(name, LOCAL)  # a completion on the full weights
        lora = save(fw_python_latest, fw_server, QWEN, 4, "num-after-full")
        r = c.post(
            HOT_LOAD,
            headers={"fireworks-deployment": name, "fireworks-model": QWEN},
            json={"identity": lora["identity"]},
        )
        assert r.status_code == 200, r.text
        assert wait_loaded(c, name, lora["identity"])["loading_state"]["stage"] == "done"
        assert deployed.full is None and deployed.full_resource is None
        assert fw_server.worker.resource(resource.id).status == RES_READY  # still held
        held.release()
        assert fw_server.worker.resource(resource.id).status == RES_STOPPED
        served_identity, served = deployment_logprobs(fw_server, name)
        assert served_identity == lora["identity"]
        assert close(served, lora["trained"]), (served, lora["trained"])
    else:
        assert deployed.full_resource is None
    assert c.delete(f"/v1/accounts/local/deployments/{dep}").status_code == 200
    if rank == 0:  # deleting releases the full-weight resource
        assert fw_server.worker.resource(resource.id).status != "READY"
