"""RLOR trainer jobs: each one is a model resource of the engine, owned by the job's account.

A job's state (docs/semantics.md "Fireworks trainer jobs") is derived from its resource each
time it is read, and written back when it changed:
- CREATING while the resource loads its base model; RUNNING once it is READY;
- FAILED, with `status{code, message}`, when the load failed (the engine keeps no half-loaded
  resource: an ERROR resource holds no model and counts against no quota);
- PAUSED once the resource is gone while the job wanted it (the worker restarted, the resource
  idled past its inactivity timeout, or its owner stopped it through the RL face);
- CANCELLED after DELETE (the resource is stopped; the row, its checkpoints and the models
  promoted from them stay).
`:resume` from PAUSED, FAILED, CANCELLED or COMPLETED loads a new resource for the job
(CREATING, then RUNNING); on a job already CREATING or RUNNING it changes nothing.
"""

from __future__ import annotations

import contextlib
import re
import sqlite3
import time
import uuid
from dataclasses import replace
from typing import Any

from trainer.api.fireworks.bodies import CreateJobBody, rfc3339, seconds_of
from trainer.api.fireworks.records import FireworksRecords, HeldResource, JobRecord
from trainer.api.tinker.binding import Binding
from trainer.contract.specs import ModelEntry, ResourceSpec
from trainer.serving.catalogue import (
    RES_CREATING,
    RES_ERROR,
    RES_LIVE,
    RES_PENDING,
    RES_READY,
    ResourceRow,
)
from trainer.serving.errors import ApiError, bad_request, failed_precondition, not_found
from trainer.serving.tenants import Principal
from trainer.serving.worker import Worker

CREATING = "JOB_STATE_CREATING"
RUNNING = "JOB_STATE_RUNNING"
FAILED = "JOB_STATE_FAILED"
PAUSED = "JOB_STATE_PAUSED"
CANCELLED = "JOB_STATE_CANCELLED"
COMPLETED = "JOB_STATE_COMPLETED"
WANTS_RESOURCE = (CREATING, RUNNING)
RESUMABLE = (FAILED, PAUSED, CANCELLED, COMPLETED)
STATES = (
    "JOB_STATE_UNSPECIFIED",
    CREATING,
    RUNNING,
    COMPLETED,
    FAILED,
    CANCELLED,
    "JOB_STATE_DELETING",
    "JOB_STATE_PENDING",
    "JOB_STATE_EXPIRED",
    "JOB_STATE_IDLE",
    "JOB_STATE_CANCELLING",
    "JOB_STATE_EARLY_STOPPED",
    PAUSED,
)
LOAD_WAIT_S = 60.0  # a create or resume answers once the load settles, or after this long
PAUSED_MESSAGE = (
    "the job's model resource is no longer loaded (the worker restarted, it was idle past its "
    "inactivity timeout, or it was stopped); POST :resume loads it again"
)
JOB_FIELD = "rlorTrainerJobId"
BASE_FIELD = "trainingConfig.baseModel"


def job_name(account: str, job_id: str) -> str:
    return f"accounts/{account}/rlorTrainerJobs/{job_id}"


def missing_job(job_id: str) -> ApiError:
    return not_found("RLOR trainer job", job_id, JOB_FIELD)


def _exists(job_id: str) -> ApiError:
    """The 409 of a taken id; the SDK then GETs the job and reuses it."""
    return ApiError(
        409,
        f"{JOB_FIELD}: RLOR trainer job {job_id!r} already exists",
        param=JOB_FIELD,
        code="already_exists",
    )


def accelerator_name(device: str | None) -> str:
    """The key of `acceleratorSeconds`: "CPU", or the CUDA device's name (`NVIDIA_H200`)."""
    import torch

    if device is None and torch.cuda.is_available():
        device = "cuda"
    if not device or not device.startswith("cuda"):
        return "CPU"
    name = torch.cuda.get_device_name(torch.device(device))
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_").upper() or "CUDA"


class JobService:
    def __init__(self, worker: Worker, records: FireworksRecords) -> None:
        self.worker = worker
        self.records = records
        self.accelerator = accelerator_name(worker.config.device)

    # -- the base model ---------------------------------------------------------------------

    def base_of(
        self, who: Principal, base_model: str, lora_rank: int
    ) -> tuple[ModelEntry, str | None]:
        """The catalogue entry a job loads, and the inference checkpoint whose merged model
        replaces its weights (a promoted full model of the caller's); a 400 naming
        `trainingConfig.baseModel` for a name this worker does not serve."""
        entry = self.worker.config.model(base_model)
        if entry is not None:
            return entry, None
        promoted = self.records.own_model(base_model, who.user)
        if promoted is None:
            served = [m.name for m in self.worker.config.models]
            raise bad_request(
                f"{BASE_FIELD}: {base_model!r} is not a model this worker serves; "
                f"supported: {served} or a model promoted in your account",
                BASE_FIELD,
            )
        if promoted.lora_rank:
            raise bad_request(
                f"{BASE_FIELD}: {base_model!r} is a LoRA adapter; train on its base model "
                f"{promoted.base_model!r} and load the adapter (load_adapter)",
                BASE_FIELD,
            )
        if lora_rank:
            raise bad_request(
                f"trainingConfig.loraRank: a promoted full model ({base_model!r}) trains with "
                "full weights only (loraRank 0)",
                "trainingConfig.loraRank",
            )
        if self.worker.checkpoints.get(promoted.checkpoint_id) is None:
            raise bad_request(
                f"{BASE_FIELD}: the checkpoint {base_model!r} was promoted from is deleted",
                BASE_FIELD,
            )
        base = self.worker.config.model(promoted.base_model)
        if base is None:
            raise bad_request(
                f"{BASE_FIELD}: {base_model!r} is of {promoted.base_model!r}, which this "
                "worker no longer serves",
                BASE_FIELD,
            )
        return base, promoted.checkpoint_id

    def _checked(self, who: Principal, body: CreateJobBody) -> ModelEntry:
        config = body.trainingConfig
        entry, _ = self.base_of(who, config.baseModel, config.loraRank)
        if config.loraRank > entry.max_lora_rank:
            raise bad_request(
                f"trainingConfig.loraRank: {config.loraRank} exceeds {entry.name}'s largest "
                f"LoRA rank {entry.max_lora_rank}",
                "trainingConfig.loraRank",
            )
        limit = config.maxContextLength
        if limit is not None and limit > entry.max_seq_length:
            raise bad_request(
                f"trainingConfig.maxContextLength: {limit} exceeds {entry.name}'s context "
                f"length {entry.max_seq_length}",
                "trainingConfig.maxContextLength",
            )
        return entry

    def _spec(self, who: Principal, job: JobRecord) -> ResourceSpec:
        entry, ref = self.base_of(who, job.base_model, job.lora_rank)
        timeout = 3600
        body = job.body
        if body.get("disableInactivityCleanup"):
            timeout = 86400
        elif body.get("inactivityTimeout"):
            timeout = int(min(86400, max(300, seconds_of(str(body["inactivityTimeout"])))))
        return ResourceSpec(
            base_model=entry.name,
            base_weights_ref=ref,
            lora_enabled=job.lora_rank > 0,
            inactive_timeout=timeout,
        )

    # -- lifecycle ---------------------------------------------------------------------------

    def create(
        self, who: Principal, job_id: str | None, body: CreateJobBody, query: dict[str, str]
    ) -> JobRecord:
        """Record the job (CREATING) and load its resource; blocking (waits for the load up
        to `LOAD_WAIT_S`): call from a worker thread. 409 when the id exists."""
        if self.worker.draining:
            raise failed_precondition("the worker is shutting down")
        ident = job_id or f"job-{uuid.uuid4().hex[:12]}"
        if self.records.job(who.user, ident) is not None:  # before the body: a retry's answer
            raise _exists(ident)
        self._checked(who, body)
        echoed = body.echoed()
        echoed.update({k: v for k, v in query.items() if v})
        now = time.time()
        job = JobRecord(
            account=who.user,
            id=ident,
            base_model=body.trainingConfig.baseModel,
            lora_rank=body.trainingConfig.loraRank,
            forward_only=body.forwardOnly,
            state=CREATING,
            created_at=now,
            updated_at=now,
            body=echoed,
        )
        try:
            self.records.insert(job)
        except sqlite3.IntegrityError:  # a concurrent create of the same id won
            raise _exists(ident) from None
        try:
            return self._load(who, job)
        except ApiError:
            self.records.delete_job(job.account, job.id)  # a refused load leaves no job
            raise

    def _load(self, who: Principal, job: JobRecord) -> JobRecord:
        spec = self._spec(who, job)
        row = self.worker.create_resource(spec, who=who)
        self.records.insert(HeldResource(job.account, job.id, row.id, time.time()))
        self.records.update_job(
            job.account,
            job.id,
            resource_id=row.id,
            state=CREATING,
            status=None,
            completed_at=None,
            updated_at=time.time(),
        )
        loaded = self.worker.resource_loaded(row.id)
        if loaded is not None:
            with contextlib.suppress(TimeoutError):  # still loading: the job reads CREATING
                loaded.result(timeout=LOAD_WAIT_S)
        return self.view(self.records.job(job.account, job.id) or job)

    def resume(self, who: Principal, job: JobRecord) -> JobRecord:
        """Blocking, like `create`."""
        job = self.view(job)
        if job.state in WANTS_RESOURCE:
            return job
        if self.worker.draining:
            raise failed_precondition("the worker is shutting down")
        return self._load(who, job)

    def delete(self, job: JobRecord) -> JobRecord:
        """Stop the job's resource (its sessions closed); the job reads CANCELLED. Blocking."""
        job = self.view(job)
        if job.resource_id and job.state in WANTS_RESOURCE:
            self.worker.stop_resource(job.resource_id, force=True)
        if job.state != CANCELLED:
            now = time.time()
            self.records.update_job(
                job.account,
                job.id,
                state=CANCELLED,
                status={"code": "CANCELLED", "message": "the job was deleted"},
                completed_at=now,
                updated_at=now,
            )
        found = self.records.job(job.account, job.id)
        return found if found is not None else job

    # -- reading -----------------------------------------------------------------------------

    def find(self, who: Principal, job_id: str) -> JobRecord:
        """The caller's job, its state brought up to date; a 404 otherwise."""
        job = self.records.job(who.user, job_id)
        if job is None:
            raise missing_job(job_id)
        return self.view(job)

    def view(self, job: JobRecord) -> JobRecord:
        """The job with its state derived from its resource (and written back if changed)."""
        if job.state not in WANTS_RESOURCE or job.resource_id is None:
            return job
        row = self.worker.store.get(ResourceRow, job.resource_id)
        live = self.worker.resources.get_live(job.resource_id)
        state, status = job.state, job.status
        if row is None:
            state, status = FAILED, {"code": "INTERNAL", "message": "the job's resource is gone"}
        elif row.status in (RES_PENDING, RES_CREATING):
            state, status = CREATING, None
        elif row.status == RES_READY and live is not None and not live.stopped:
            state, status = RUNNING, None
        elif row.status == RES_ERROR:
            message = str((row.error or {}).get("message") or "loading the base model failed")
            state, status = FAILED, {"code": "INTERNAL", "message": message}
        elif row.status not in RES_LIVE or live is None:
            state, status = PAUSED, {"code": "UNAVAILABLE", "message": PAUSED_MESSAGE}
        if (state, status) == (job.state, job.status):
            return job
        now = time.time()
        self.records.update_job(job.account, job.id, state=state, status=status, updated_at=now)
        return replace(job, state=state, status=status, updated_at=now)

    def binding(self, job: JobRecord) -> Binding:
        assert job.resource_id is not None
        spec = self.worker.store.get(ResourceRow, job.resource_id)
        base = str((spec.spec if spec is not None else {}).get("base_model") or job.base_model)
        return Binding(
            account=job.account,
            job_id=job.id,
            resource_id=job.resource_id,
            base_model=base,
            lora_rank=job.lora_rank,
            forward_only=job.forward_only,
        )

    def held_seconds(self, job: JobRecord) -> float:
        """Seconds the job's resources have been held (loading included), all its lives."""
        total = 0.0
        now = time.time()
        for held in self.records.held(job.account, job.id):
            row = self.worker.store.get(ResourceRow, held.resource_id)
            if row is None:
                continue
            end = now if row.status in RES_LIVE else row.updated_at
            total += max(0.0, end - held.started_at)
        return total

    def to_json(self, job: JobRecord) -> dict[str, Any]:
        body = dict(job.body)
        config = dict(body.pop("trainingConfig", {}))
        entry, _ = self._entry_or_none(job)
        if "maxContextLength" not in config and entry is not None:
            config["maxContextLength"] = entry.max_seq_length
        out: dict[str, Any] = {
            **body,
            "name": job_name(job.account, job.id),
            "state": job.state,
            "trainingConfig": config,
            "serviceMode": body.get("serviceMode", True),
            "forwardOnly": job.forward_only,
            "createdBy": job.account,
            "createTime": rfc3339(job.created_at),
            "updateTime": rfc3339(job.updated_at),
            "acceleratorSeconds": {self.accelerator: str(int(self.held_seconds(job)))},
            "nodeCount": body.get("nodeCount", 1),
        }
        if job.completed_at is not None:
            out["completedTime"] = rfc3339(job.completed_at)
        if job.status is not None:
            out["status"] = dict(job.status)
            out["statusMessage"] = str(job.status.get("message", ""))
        return out

    def _entry_or_none(self, job: JobRecord) -> tuple[ModelEntry | None, str | None]:
        entry = self.worker.config.model(job.base_model)
        if entry is not None:
            return entry, None
        promoted = self.records.own_model(job.base_model, job.account)
        if promoted is None:
            return None, None
        return self.worker.config.model(promoted.base_model), promoted.checkpoint_id
