"""`/hot_load/v1/models/hot_load`: load a trainer's sampler checkpoint into a deployment, and
read what it serves (docs/semantics.md §24; the SDK's `DeploymentManager.hotload`,
`hotload_check_status` and `wait_for_hotload`).

The deployment is named by the `fireworks-deployment: accounts/<a>/deployments/<d>` header
(the caller's own account only; another's answers as a missing one). The POST's `identity` is
a sampler checkpoint's path as a save returned it (`<account>/run-<32 hex>/<name>` of the
Fireworks SDK, or a `tinker://` sampler path), one the caller owns; the worker loads it from
its own storage in the background and answers once that load has ended, or after
`SETTLE_S` with it still in flight (the SDK polls the GET until it ends; completions answer
425 meanwhile). `incremental_snapshot_metadata` is
accepted and ignored: no bytes cross the wire, the identity names the whole weights.
"""

from __future__ import annotations

import hashlib
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, Field

from trainer.api.fireworks.auth import principal_of
from trainer.api.fireworks.deployed import Snapshot
from trainer.api.fireworks.deployments import DeploymentService, deployment_name, parsed
from trainer.api.fireworks.records import DeploymentRecord, JobRecord
from trainer.api.fireworks.routes_deployments import face_of, json_body
from trainer.api.fireworks.service import FireworksFace
from trainer.api.tinker import names, paths
from trainer.checkpoint.export import ENCRYPTED_EXPORT, stored_encrypted
from trainer.checkpoint.store import INFERENCE, CheckpointRecord
from trainer.serving.errors import ApiError, bad_request, not_found
from trainer.serving.tenants import Principal

router = APIRouter()
ROUTE = "/hot_load/v1/models/hot_load"
HEADER = "fireworks-deployment"
SETTLE_S = 30.0  # the SDK's waiter sleeps 5 s between polls: a short load ends before it asks


class IncrementalMetadata(BaseModel):
    model_config = ConfigDict(extra="allow")

    previous_snapshot_identity: str | None = Field(default=None, max_length=1024)
    compression_format: str | None = Field(default=None, max_length=64)
    checksum_format: str | None = Field(default=None, max_length=64)


class HotLoadBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    identity: str = Field(min_length=1, max_length=1024)
    reset_prompt_cache: bool | None = None
    incremental_snapshot_metadata: IncrementalMetadata | None = None


def deployment_of(request: Request) -> tuple[Principal, str]:
    """The caller and the deployment id its `fireworks-deployment` header names (a 400
    naming the header when absent or malformed; 404 for another account's)."""
    who = principal_of(request)
    name = request.headers.get(HEADER, "").strip()
    parts = name.split("/")
    if len(parts) != 4 or parts[0] != "accounts" or parts[2] != "deployments" or not parts[3]:
        raise bad_request(
            f"{HEADER}: send the header accounts/<account>/deployments/<id> (got {name[:200]!r})",
            HEADER,
        )
    if parts[1] != who.user:
        raise not_found("deployment", parts[3], "deploymentId")
    return who, parts[3]


def _record_of(
    face: FireworksFace, identity: str, deployment: DeploymentRecord, who: Principal
) -> CheckpointRecord:
    """The engine checkpoint `identity` names, one `who` owns (404 otherwise)."""
    bridge = face.bridge
    if identity.startswith(paths.PREFIX):
        return paths.resolve(bridge, identity, "identity", who)
    account = names.account_of(who, None)
    parts = identity.split("/")
    if len(parts) == 3 and names.RUN_ID.fullmatch(parts[1]):
        scopes: list[str | None] = [None]
    elif len(parts) == 1 and names.DNS_LABEL.fullmatch(identity):
        scopes = [f"job:{account}/{job}" for job in _trainer_jobs(face, deployment)]
    else:
        raise bad_request(
            f"identity: {identity[:200]!r} is not a snapshot identity (what "
            "save_weights_for_sampler returned: '<account>/run-<32 hex>/<name>', the saved name "
            "of the deployment's trainer job, or tinker://...)",
            "identity",
        )
    for scope in scopes:
        try:
            return names.resolve(bridge, identity, "identity", who, account, scope)[1]
        except ApiError:  # missing, another account's or not its owner's: the same 404
            continue
    raise not_found("snapshot", identity, "identity")


def _trainer_jobs(face: FireworksFace, deployment: DeploymentRecord) -> list[str]:
    """The trainer jobs whose saved names a bare identity may be (the SDK's `WeightSyncer`
    hot-loads the name it saved): the deployment's `hotLoadTrainerJob`, then the account's
    jobs made with `hot_load_deployment_id` naming it, newest first."""
    found: list[str] = []
    attached = str(deployment.body.get("hotLoadTrainerJob") or "")
    if attached.count("/") == 3:
        found.append(attached.rsplit("/", 1)[1])
    full = deployment_name(deployment.account, deployment.id)
    jobs = face.records.select(
        JobRecord, "account = ?", (deployment.account,), "ORDER BY created_at DESC"
    )
    for job in jobs:
        named = (job.body.get("hotLoadDeploymentId"), job.body.get("deploymentId"))
        if (deployment.id in named or full in named) and job.id not in found:
            found.append(job.id)
    return found


def snapshot_of(
    face: FireworksFace, identity: str, deployment: DeploymentRecord, who: Principal
) -> Snapshot:
    """The sampler checkpoint a hot-load names, checked against the deployment's base model
    (a 400 naming `identity`)."""
    bridge = face.bridge
    base_model = deployment.entry
    record = _record_of(face, identity, deployment, who)
    if record.type != INFERENCE:
        raise bad_request(
            f"identity: {identity[:200]!r} is a training checkpoint; hot-load the path "
            "save_weights_for_sampler returned",
            "identity",
        )
    if record.base_model != base_model:
        raise bad_request(
            f"identity: {identity[:200]!r} holds weights of {record.base_model!r}, not of the "
            f"deployment's base model {base_model!r}",
            "identity",
        )
    if stored_encrypted(bridge.worker.checkpoints, record.id):
        raise bad_request(f"identity: {identity[:200]} {ENCRYPTED_EXPORT}", "identity")
    return Snapshot(identity, record.id, bool(record.lora_rank))


def pod_of(deployment_id: str, trainer_job: str | None) -> str:
    """A replica's pod name (`identity`, beside `current_snapshot_identity`): new when the
    deployment is re-attached to another trainer job, the pod roll SDK 1.2.9's
    `reattach_trainer` waits for (1.2.30 waits for READY and the job instead)."""
    digest = hashlib.sha256((trainer_job or "").encode()).hexdigest()[:8]
    return f"{deployment_id}-{digest}"


@router.post(ROUTE)
async def hot_load(request: Request) -> dict[str, Any]:
    who, deployment_id = deployment_of(request)
    face = face_of(request)
    service: DeploymentService = face.deployments
    data = await json_body(request)
    body = parsed(HotLoadBody, data)

    def run() -> dict[str, Any]:
        record = service.find(who, deployment_id)
        snapshot = snapshot_of(face, body.identity, record, who)
        deployed = service.deployed(record.account, record.id)
        if deployed is None or record.state != "READY":
            raise bad_request(
                f"{HEADER}: deployment {deployment_name(who.user, deployment_id)!r} serves no "
                f"replicas (state {record.state}); scale it up first",
                HEADER,
            )
        deployed.hot_load(snapshot)
        deployed.settle(SETTLE_S)
        stage = deployed.replica()["loading_state"]["stage"]
        return {"identity": snapshot.identity, "status": stage}

    return await run_in_threadpool(run)


@router.get(ROUTE)
async def hot_load_status(request: Request) -> dict[str, Any]:
    """`{replicas: [...]}`: one entry per replica (`maxReplicaCount`, at least one while it
    serves), none while it is scaled to zero, creating or failed."""
    who, deployment_id = deployment_of(request)
    service: DeploymentService = face_of(request).deployments

    def run() -> dict[str, Any]:
        record = service.find(who, deployment_id)
        deployed = service.deployed(record.account, record.id)
        count = int(service.to_json(record)["replicaCount"])
        if deployed is None or record.state != "READY" or count == 0:
            return {"replicas": []}
        replica = deployed.replica()
        pod = pod_of(record.id, record.body.get("hotLoadTrainerJob"))
        return {"replicas": [dict(replica, identity=f"{pod}-{i}") for i in range(count)]}

    return await run_in_threadpool(run)
