"""Deployments: generators of a base model on this worker that hot-load a trainer's sampler
checkpoints (docs/semantics.md §24), recorded in `fireworks.sqlite`.

States: CREATING while the base model loads, then READY (scaled to zero included: it then
serves no replicas), or FAILED with `status{code, message}` when the load failed. DELETE
releases what it serves and removes the record (a GET then answers 404, what the SDK polls
for). A restart brings every deployment back READY; each one that had replicas loads its base
model again and hot-loads its last identity in the background (`restore`).
"""

from __future__ import annotations

import sqlite3
import threading
import time
from dataclasses import replace
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from trainer.api.fireworks.bodies import JOB_ID, rfc3339
from trainer.api.fireworks.deployed import Deployed, Snapshot
from trainer.api.fireworks.records import DeploymentRecord, FireworksRecords
from trainer.api.fireworks.targets import Target
from trainer.api.tinker.bridge import TinkerBridge
from trainer.serving.errors import ApiError, bad_request, failed_precondition, from_pydantic
from trainer.serving.errors import not_found as _not_found
from trainer.serving.tenants import Principal
from trainer.serving.worker import Worker

CREATING, READY, FAILED = "CREATING", "READY", "FAILED"
ID_FIELD = "deploymentId"
LOAD_WAIT_S = 60.0  # a create answers once the base model loaded, or after this long
TRANSITIONS = ("ASYNC", "SYNC", "HOT_LOAD_TRANSITION_TYPE_UNSPECIFIED", "UNSPECIFIED")
# updateMask paths (snake_case, as the SDK sends them) -> the body's field
MUTABLE = {
    "hot_load_trainer_job": "hotLoadTrainerJob",
    "hot_load_transition_type": "hotLoadTransitionType",
    "min_replica_count": "minReplicaCount",
    "max_replica_count": "maxReplicaCount",
    "description": "description",
    "display_name": "displayName",
    "annotations": "annotations",
}


class Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Placement(Wire):
    region: str | None = Field(default=None, max_length=128)
    regions: list[str] | None = None
    multiRegion: str | None = Field(default=None, max_length=128)


class PatchBody(Wire):
    """The fields a PATCH may change (every one optional)."""

    description: str | None = Field(default=None, max_length=4096)
    displayName: str | None = Field(default=None, max_length=256)
    minReplicaCount: int | None = Field(default=None, ge=0, le=1024)
    maxReplicaCount: int | None = Field(default=None, ge=0, le=1024)
    hotLoadTrainerJob: str | None = Field(default=None, max_length=512)
    hotLoadTransitionType: str | None = Field(default=None, max_length=64)
    annotations: dict[str, str] | None = None

    @field_validator("hotLoadTransitionType")
    @classmethod
    def _transition(cls, value: str | None) -> str | None:
        if value is not None and value.strip().upper() not in TRANSITIONS:
            raise ValueError(f"must be one of {list(TRANSITIONS[:2])}")
        return value.strip().upper() if value is not None else None


class CreateBody(PatchBody):
    """What `DeploymentManager._build_deployment_body` sends (both SDK lines); the
    infrastructure fields are stored and echoed and change nothing on this worker."""

    baseModel: str = Field(min_length=1, max_length=512)
    minReplicaCount: int | None = Field(default=0, ge=0, le=1024)
    maxReplicaCount: int | None = Field(default=1, ge=0, le=1024)
    enableHotLoad: bool = True
    forTraining: bool = False
    deploymentShape: str | None = Field(default=None, max_length=512)
    acceleratorType: str | None = Field(default=None, max_length=128)
    acceleratorCount: int | None = Field(default=None, ge=0, le=1024)
    placement: Placement | None = None
    hotLoadBucketType: str | None = Field(default=None, max_length=64)
    extraArgs: list[str] | None = None
    extraValues: dict[str, str] | None = None
    preemptible: bool = False


def deployment_name(account: str, deployment_id: str) -> str:
    return f"accounts/{account}/deployments/{deployment_id}"


def missing(deployment_id: str) -> ApiError:
    return _not_found("deployment", deployment_id, ID_FIELD)


M = TypeVar("M", bound=BaseModel)


def parsed(model: type[M], data: Any) -> M:
    if not isinstance(data, dict):
        raise bad_request("body: must be a JSON object", "body")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_pydantic(exc) from None


def check_id(deployment_id: str) -> str:
    if not JOB_ID.fullmatch(deployment_id):
        raise bad_request(
            f"{ID_FIELD}: {deployment_id[:200]!r} is not a deployment id (1-63 lowercase "
            "letters, digits or '-', starting with a letter or digit)",
            ID_FIELD,
        )
    return deployment_id


def _check_trainer_job(who: Principal, body: PatchBody) -> None:
    job = body.hotLoadTrainerJob
    if not job:
        return
    parts = job.split("/")
    if len(parts) != 4 or parts[0::2] != ["accounts", "rlorTrainerJobs"] or parts[1] != who.user:
        raise bad_request(
            f"hotLoadTrainerJob: {job[:200]!r} is not a trainer job of your account "
            f"(accounts/{who.user}/rlorTrainerJobs/<id>)",
            "hotLoadTrainerJob",
        )


class DeploymentService:
    def __init__(self, worker: Worker, records: FireworksRecords, bridge: TinkerBridge) -> None:
        self.worker = worker
        self.records = records
        self.bridge = bridge
        self.lock = threading.Lock()
        self.live: dict[tuple[str, str], Deployed] = {}
        self.closed = False

    # -- lifecycle ---------------------------------------------------------------------------

    def create(self, who: Principal, deployment_id: str, data: Any) -> DeploymentRecord:
        """Record the deployment (CREATING) and bring it up; blocking (waits for the base
        model up to `LOAD_WAIT_S`). 409 when the id exists."""
        if self.worker.draining:
            raise failed_precondition("the worker is shutting down")
        if self.records.deployment(who.user, deployment_id) is not None:
            raise _exists(deployment_id)
        body = parsed(CreateBody, data)
        entry = self.worker.config.model(body.baseModel)
        snapshot = None if entry is not None else self._promoted(who, body.baseModel)
        if snapshot is not None:
            entry = self.worker.config.model(snapshot[0])
        if entry is None:
            served = [m.name for m in self.worker.config.models]
            raise bad_request(
                f"baseModel: {body.baseModel!r} is not a model this worker serves nor one "
                f"promoted in this account; supported: {served}",
                "baseModel",
            )
        first = None if snapshot is None else snapshot[1]
        _check_trainer_job(who, body)
        now = time.time()
        record = DeploymentRecord(
            account=who.user,
            id=deployment_id,
            base_model=body.baseModel,
            entry=entry.name,
            state=CREATING,
            created_at=now,
            updated_at=now,
            body=body.model_dump(exclude_none=True),
        )
        if first is not None:  # a promoted model: its checkpoint, hot-loaded from the start
            record = replace(
                record, identity=first.identity, checkpoint_id=first.checkpoint_id, lora=first.lora
            )
        try:
            self.records.insert(record)
        except sqlite3.IntegrityError:
            raise _exists(deployment_id) from None
        if _replicas(record):
            self._bring_up(record, who, first).wait(LOAD_WAIT_S)
        else:
            self._set(record, state=READY)
        return self.find(who, deployment_id)

    def _promoted(self, who: Principal, name: str) -> tuple[str, Snapshot] | None:
        """`accounts/<a>/models/<m>` promoted in `who`'s account (a PEFT adapter or a merged
        full model) whose checkpoint is still stored: its catalogue base model, and the
        snapshot a deployment of it serves (docs/semantics.md §24). None for anything else,
        another account's model included (it answers as a missing one)."""
        model = self.records.own_model(name, who.user)
        if model is None or self.worker.checkpoints.get(model.checkpoint_id) is None:
            return None
        return model.base_model, Snapshot(name, model.checkpoint_id, model.lora_rank > 0)

    def _bring_up(
        self, record: DeploymentRecord, owner: Principal, snapshot: Snapshot | None
    ) -> threading.Event:
        """Start serving `record` in the background (CREATING until the base model serves,
        then READY and, with `snapshot`, its hot-load); set once settled."""
        deployed = Deployed(
            self.bridge,
            deployment_name(record.account, record.id),
            record.entry,
            owner,
            lambda s: self._loaded(record.account, record.id, s),
        )
        if snapshot is not None:
            deployed.expect(snapshot)
        with self.lock:
            self.live[(record.account, record.id)] = deployed
        done = threading.Event()

        def run() -> None:
            try:
                deployed.start()
            except Exception as exc:  # a failed load is data: FAILED with its reason
                message = getattr(exc, "message", None) or str(exc) or type(exc).__name__
                if not deployed.stopped:
                    self._set(record, state=FAILED, status={"code": "INTERNAL", "message": message})
                    deployed.stop()
                done.set()
                return
            if not deployed.stopped:
                self._set(record, state=READY, status=None)
                if snapshot is not None:
                    deployed.hot_load(snapshot)
            done.set()

        threading.Thread(target=run, name=f"deployment {record.id}", daemon=True).start()
        return done

    def _set(self, record: DeploymentRecord, **changes: Any) -> None:
        if self.closed:
            return
        self.records.update_deployment(record.account, record.id, updated_at=time.time(), **changes)

    def _loaded(self, account: str, deployment_id: str, snapshot: Snapshot) -> None:
        """A hot-load succeeded: remember it, for a restart to load it again."""
        if self.closed or self.records.deployment(account, deployment_id) is None:
            return
        self.records.update_deployment(
            account,
            deployment_id,
            identity=snapshot.identity,
            checkpoint_id=snapshot.checkpoint_id,
            lora=snapshot.lora,
            updated_at=time.time(),
        )

    def restore(self) -> int:
        """At start: every recorded deployment READY again; those with replicas load their
        base model and last identity in the background. The count restored."""
        rows = self.records.select(DeploymentRecord)
        for record in rows:
            if record.state == FAILED:
                continue
            self._set(record, state=READY, status=None)
            if not _replicas(record):
                continue
            owner = self.worker.principals(record.account) or Principal(record.account)
            self._bring_up(record, owner, _snapshot_of(record))
        return len(rows)

    def update(
        self, who: Principal, deployment_id: str, data: Any, mask: str | None
    ) -> DeploymentRecord:
        """Apply a PATCH (the fields of `updateMask`, else every field sent); replica counts
        of 0 release what it serves, from 0 bring it back with its last identity."""
        record = self.find(who, deployment_id)
        body = parsed(PatchBody, data)
        _check_trainer_job(who, body)
        sent = body.model_dump(exclude_unset=True)
        if mask is not None:
            fields = [f.strip() for f in mask.split(",") if f.strip()]
            unknown = [f for f in fields if f not in MUTABLE and f not in MUTABLE.values()]
            if unknown:
                raise bad_request(
                    f"updateMask: {unknown[0][:100]!r} is not a field a PATCH changes; "
                    f"supported: {sorted(MUTABLE)}",
                    "updateMask",
                )
            wanted = {MUTABLE.get(f, f) for f in fields}
            sent = {k: v for k, v in sent.items() if k in wanted}
        merged = {**record.body, **sent}
        merged = {k: v for k, v in merged.items() if v is not None}
        low, high = merged.get("minReplicaCount", 0), merged.get("maxReplicaCount", 1)
        if low > high:
            raise bad_request(
                f"minReplicaCount: {low} exceeds maxReplicaCount {high}", "minReplicaCount"
            )
        was = _replicas(record)
        self._set(record, body=merged)
        updated = replace(record, body=merged)
        if was and not _replicas(updated):
            self._stop(record)
        elif not was and _replicas(updated) and record.state != FAILED:
            self._set(record, state=CREATING)
            self._bring_up(updated, who, _snapshot_of(record)).wait(LOAD_WAIT_S)
        return self.find(who, deployment_id)

    def delete(self, who: Principal, deployment_id: str) -> DeploymentRecord:
        record = self.find(who, deployment_id)
        self._stop(record)
        self.records.delete_deployment(record.account, record.id)
        return replace(record, state="DELETED", updated_at=time.time())

    def _stop(self, record: DeploymentRecord) -> None:
        with self.lock:
            deployed = self.live.pop((record.account, record.id), None)
        if deployed is not None:
            deployed.stop()

    def close(self) -> None:
        """At shutdown, before the records close: loads in flight end, nothing is written."""
        self.closed = True
        with self.lock:
            deployed = list(self.live.values())
        for one in deployed:
            with one.lock:
                one.stopped = True
                one.pending = None

    # -- reading -----------------------------------------------------------------------------

    def find(self, who: Principal, deployment_id: str) -> DeploymentRecord:
        record = self.records.deployment(who.user, deployment_id)
        if record is None:
            raise missing(deployment_id)
        return record

    def deployed(self, account: str, deployment_id: str) -> Deployed | None:
        with self.lock:
            return self.live.get((account, deployment_id))

    def resolve(self, name: str, who: Principal) -> Target | None:
        """The `Targets` resolver of `accounts/<a>/deployments/<d>` (None: another kind)."""
        parts = name.split("/")
        if len(parts) != 4 or parts[0] != "accounts" or parts[2] != "deployments":
            return None
        record = self.records.deployment(parts[1], parts[3]) if parts[1] == who.user else None
        if record is None:
            raise _not_found("model", name, "model")
        if record.state == FAILED:
            message = (record.status or {}).get("message", "")
            raise bad_request(f"model: deployment {name!r} failed: {message}", "model")
        if record.state == CREATING:
            raise ApiError(
                425,
                f"model: deployment {name!r} is loading its base model; retry shortly",
                param="model",
                code="too_early",
            )
        deployed = self.deployed(record.account, record.id)
        if deployed is None or not _replicas(record):
            raise bad_request(f"model: deployment {name!r} is scaled to zero", "model")
        return deployed.hold(name)

    def to_json(self, record: DeploymentRecord) -> dict[str, Any]:
        body = dict(record.body)
        out: dict[str, Any] = {
            **body,
            "name": deployment_name(record.account, record.id),
            "baseModel": record.base_model,
            "state": record.state,
            "createTime": rfc3339(record.created_at),
            "updateTime": rfc3339(record.updated_at),
            "createdBy": record.account,
            "minReplicaCount": body.get("minReplicaCount", 0),
            "maxReplicaCount": body.get("maxReplicaCount", 1),
            "replicaCount": _replicas(record) if record.state == READY else 0,
            "hotLoadTransitionType": _transition(body.get("hotLoadTransitionType")),
        }
        if record.status is not None:
            out["status"] = dict(record.status)
            out["statusMessage"] = str(record.status.get("message", ""))
        if record.identity is not None:
            out["hotLoadSnapshotIdentity"] = record.identity
        return out


def _exists(deployment_id: str) -> ApiError:
    """The 409 of a taken id; the SDK then GETs the deployment and reuses it."""
    return ApiError(
        409,
        f"{ID_FIELD}: deployment {deployment_id!r} already exists",
        param=ID_FIELD,
        code="already_exists",
    )


def _replicas(record: DeploymentRecord) -> int:
    """The replicas it serves with (at least one unless scaled to zero)."""
    high = int(record.body.get("maxReplicaCount", 1))
    low = int(record.body.get("minReplicaCount", 0))
    return max(high, low)


def _transition(value: str | None) -> str:
    """Unset resolves to ASYNC for hot-load deployments, as the control plane does."""
    return value if value in ("ASYNC", "SYNC") else "ASYNC"


def _snapshot_of(record: DeploymentRecord) -> Snapshot | None:
    if record.identity is None or record.checkpoint_id is None:
        return None
    return Snapshot(record.identity, record.checkpoint_id, record.lora)
