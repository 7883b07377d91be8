"""What the Fireworks control plane reads besides jobs: a job's checkpoints, their promotion to
models, models (the catalogue's and the promoted ones) and training shapes.

A job's checkpoints are the engine checkpoints of every session opened on any resource the job
has held, named as the Tinker face recorded them (`save_state("step-4")` -> `step-4`), else by
their engine id. Types, as the SDK and cookbook read them (`training/utils/checkpoints.py`
takes types ending in `TRAINING` or `TRAINING_LORA` as resumable):
- a training checkpoint: `CHECKPOINT_TYPE_TRAINING` (full weights) or `..._TRAINING_LORA`;
- an inference (sampler) checkpoint: `CHECKPOINT_TYPE_INFERENCE_BASE` (a merged full model:
  full weights, or a LoRA adapter saved with `checkpoint_type="merged_base"`) or
  `..._INFERENCE_LORA` (an adapter beside its merged model); promotable unless encrypted.
Promotion records a model `accounts/<a>/models/<m>` that serves the checkpoint's files in place:
the merged model of a full-weight checkpoint (a job's base model through `base_weights_ref`),
or the PEFT adapter of a LoRA one (`load_adapter` through the Tinker bridge's resolvers).
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.api.fireworks.bodies import MODEL_ID, PromoteBody, rfc3339
from trainer.api.fireworks.jobs import JobService, job_name
from trainer.api.fireworks.records import JobRecord, PromotedModel, model_path
from trainer.api.tinker.records import TinkerCheckpoint, TinkerRecords
from trainer.checkpoint.base_weights import cached_config
from trainer.checkpoint.export import stored_encrypted
from trainer.checkpoint.store import ADAPTER_DIR, INFERENCE, MERGED_DIR, CheckpointRecord
from trainer.contract.specs import ModelEntry
from trainer.serving.errors import ApiError, bad_request, not_found
from trainer.serving.tenants import Principal

TRAINING_FULL, TRAINING_LORA = "CHECKPOINT_TYPE_TRAINING", "CHECKPOINT_TYPE_TRAINING_LORA"
INFERENCE_FULL, INFERENCE_LORA = "CHECKPOINT_TYPE_INFERENCE_BASE", "CHECKPOINT_TYPE_INFERENCE_LORA"
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
SHAPE_VERSION = "v1"


@dataclass(frozen=True)
class JobCheckpoint:
    name: str  # the last segment of accounts/<a>/rlorTrainerJobs/<j>/checkpoints/<name>
    record: CheckpointRecord
    type: str
    promotable: bool


class Catalog:
    def __init__(self, jobs: JobService, tinker: TinkerRecords | None) -> None:
        self.jobs = jobs
        self.worker = jobs.worker
        self.records = jobs.records
        self.tinker = tinker

    # -- checkpoints -------------------------------------------------------------------------

    def checkpoints(self, job: JobRecord) -> list[JobCheckpoint]:
        """Oldest first; names unique within the job."""
        sessions: list[str] = []
        for held in self.records.held(job.account, job.id):
            sessions += [s.id for s in self.worker.store.sessions_of(held.resource_id)]
        records = self.worker.checkpoints.list(
            session_ids=sessions, limit=1 << 30, oldest_first=True
        )
        out: list[JobCheckpoint] = []
        taken: set[str] = set()
        for record in records:
            rows = self._tinker_rows(record)
            name = rows[0].name if rows else record.id
            if name in taken:
                name = f"{name}-{record.id[5:13]}"
            taken.add(name)
            lora = bool(record.lora_rank)
            if record.type == INFERENCE:
                kind = inference_type(record, any(row.merged for row in rows))
                store = self.worker.checkpoints
                promotable = not stored_encrypted(store, record.id)
            else:
                kind, promotable = (TRAINING_LORA if lora else TRAINING_FULL), False
            out.append(JobCheckpoint(name, record, kind, promotable))
        return out

    def _tinker_rows(self, record: CheckpointRecord) -> list[TinkerCheckpoint]:
        """The Tinker face's rows naming an engine checkpoint (its path, its logical name)."""
        if self.tinker is None:
            return []
        return self.tinker.select(TinkerCheckpoint, "checkpoint_id = ?", (record.id,))

    def checkpoint_json(self, job: JobRecord, found: JobCheckpoint) -> dict[str, Any]:
        return {
            "name": f"{job_name(job.account, job.id)}/checkpoints/{found.name}",
            "createTime": rfc3339(found.record.created_at),
            "updateTime": rfc3339(found.record.created_at),
            "checkpointType": found.type,
            "promotable": found.promotable,
            "step": found.record.step,
        }

    # -- promotion ---------------------------------------------------------------------------

    def promote(self, who: Principal, checkpoint: str, body: PromoteBody) -> PromotedModel:
        model_id = output_model_id(who, body)
        job_id = (body.trainer_job_id or "").split("/")[-1]
        if not body.trainer_job_id:
            raise bad_request(
                "trainer_job_id: name the job the checkpoint belongs to "
                "(accounts/<account>/rlorTrainerJobs/<id>)",
                "trainer_job_id",
            )
        if body.trainer_job_id not in (job_id, job_name(who.user, job_id)):
            raise not_found("RLOR trainer job", body.trainer_job_id, "trainer_job_id")
        job = self.jobs.find(who, job_id)
        found = next((c for c in self.checkpoints(job) if c.name == checkpoint), None)
        if found is None:
            raise not_found("checkpoint", checkpoint, "checkpoint")
        if not found.promotable:
            raise bad_request(
                f"checkpoint: {checkpoint!r} is a {found.type} checkpoint, which is not "
                "promotable (save_weights_for_sampler writes promotable ones)",
                "checkpoint",
            )
        return self.record_model(who, model_id, found, job.id, body.output_model)

    def record_model(
        self, who: Principal, model_id: str, found: JobCheckpoint, owner: str, output_model: str
    ) -> PromotedModel:
        """Record model `model_id` of `who`'s account serving checkpoint `found` of `owner`: a
        job's id, or a serverless training session's name (`accounts/<a>/trainingSessions/
        <ts>`); a 409 naming `output_model` when the model exists."""
        model = PromotedModel(
            account=who.user,
            id=model_id,
            checkpoint_id=found.record.id,
            checkpoint_name=found.name,
            job_id=owner,
            base_model=found.record.base_model,
            # an adapter serves as a PEFT addon; a `merged_base` save as the merged model
            lora_rank=int(found.record.lora_rank or 0) if found.type == INFERENCE_LORA else 0,
            created_at=time.time(),
        )
        try:
            self.records.insert(model)
        except sqlite3.IntegrityError:
            raise ApiError(
                409,
                f"output_model: model {output_model!r} already exists",
                param="output_model",
                code="already_exists",
            ) from None
        return model

    def model_dir(self, model: PromotedModel) -> Path | None:
        """The directory a promoted model serves: its PEFT adapter, or its merged model."""
        record = self.worker.checkpoints.get(model.checkpoint_id)
        if record is None:
            return None
        return Path(record.path) / (ADAPTER_DIR if model.lora_rank else MERGED_DIR)

    def resolve(self, name: str, who: Principal) -> Path | None:
        """The Tinker bridge's resolver for `load_adapter` (`model_resolvers`):
        `accounts/<a>/models/<m>` -> the PEFT directory of a LoRA model promoted in account
        `a`, when `a` is `who`'s; None otherwise (the same for another user's model, a full
        model, or a name that is no model), so the caller answers as for a missing one."""
        model = self.records.own_model(name, who.user)
        if model is None or not model.lora_rank:
            return None
        return self.model_dir(model)

    # -- models and shapes -------------------------------------------------------------------

    def catalogue_model(self, name: str) -> ModelEntry | None:
        return self.worker.config.model(name)

    def model_json(self, name: str, entry: ModelEntry, model: PromotedModel | None) -> dict:
        config = cached_config(entry.location, entry.revision) or {}
        details = base_model_details(config)
        out: dict[str, Any] = {
            "name": name,
            "displayName": name.split("/")[-1],
            "state": "READY",
            "kind": "HF_BASE_MODEL",
            "contextLength": entry.max_seq_length,
            "supportsLora": True,
            "tunable": True,
            "baseModelDetails": details,
        }
        if model is None:
            return out
        out["createTime"] = rfc3339(model.created_at)
        out["baseModel"] = model.base_model
        if "/" in model.job_id:  # a serverless training session's name (no job id has one)
            owner = out["trainingSession"] = model.job_id
        else:
            owner = out["trainerJob"] = job_name(model.account, model.job_id)
        out["checkpoint"] = f"{owner}/checkpoints/{model.checkpoint_name}"
        if self.model_dir(model) is None:
            out["state"] = "FAILED"
            out["status"] = {"code": "NOT_FOUND", "message": "its checkpoint was deleted"}
        if model.lora_rank:
            out["kind"] = "HF_PEFT_ADDON"
            out["peftDetails"] = {"baseModel": model.base_model, "r": model.lora_rank}
            out["tunable"] = False
        return out

    def shape_version(self, account: str, shape: str) -> dict[str, Any] | None:
        """A training shape named after a catalogue model's last segment (`qwen3-tiny`: full
        weights, `qwen3-tiny-lora`: LoRA), with one version."""
        lora = shape.endswith("-lora")
        stem = shape.removesuffix("-lora")
        entry = next((m for m in self.worker.config.models if m.name.split("/")[-1] == stem), None)
        if entry is None:
            return None
        name = f"accounts/{account}/trainingShapes/{shape}/versions/{SHAPE_VERSION}"
        return {
            "name": name,
            "validated": True,
            "latestValidated": True,
            "snapshot": {
                "baseModel": entry.name,
                "trainerImageTag": "local",
                "maxSupportedContextLength": entry.max_seq_length,
                "nodeCount": 1,
                "deploymentShapeVersion": "",
                "deploymentImageTag": "",
                "acceleratorType": self.jobs.accelerator,
                "acceleratorCount": 1,
                "baseModelWeightPrecision": entry.dtype.upper(),
                "trainerMode": "LORA_TRAINER" if lora else "POLICY_TRAINER",
                "maxLoraRank": entry.max_lora_rank if lora else 0,
                "trainerShardingScheme": {"pipelineParallelism": 1},
            },
        }


def inference_type(record: CheckpointRecord, merged: bool) -> str:
    """A sampler checkpoint's type: a LoRA adapter, or a full model (full weights, or a LoRA
    adapter saved `merged_base`: folded into the base weights)."""
    return INFERENCE_LORA if record.lora_rank and not merged else INFERENCE_FULL


def base_model_details(config: dict[str, Any]) -> dict[str, Any]:
    """`baseModelDetails` from a model's config.json: `moe` when it has more than one expert
    (at the top level or in `text_config`)."""
    scopes = [config, config.get("text_config") or {}]
    experts = 0
    for scope in scopes:
        for key in EXPERT_KEYS:
            value = scope.get(key) if isinstance(scope, dict) else None
            if isinstance(value, int) and not isinstance(value, bool):
                experts = max(experts, value)
    return {
        "moe": experts > 1,
        "numExperts": experts,
        "modelType": str(config.get("model_type") or ""),
        "worldSize": 1,
        "checkpointFormat": "HUGGINGFACE",
        "tunable": True,
    }


def output_model_id(who: Principal, body: PromoteBody) -> str:
    """The id of the model a promotion makes: `output_model` is `accounts/<caller>/models/<id>`
    (a 400 naming `output_model` otherwise)."""
    path = model_path(body.output_model)
    if path is None:
        raise bad_request(
            f"output_model: {body.output_model!r} is not accounts/<account>/models/<id>",
            "output_model",
        )
    account, model_id = path
    if account != who.user:
        raise bad_request(
            f"output_model: models are promoted into your own account (accounts/{who.user})",
            "output_model",
        )
    if not MODEL_ID.fullmatch(model_id):
        raise bad_request(
            f"output_model: model id {model_id!r} must be 1-63 lowercase letters, digits or '-'",
            "output_model",
        )
    return model_id
