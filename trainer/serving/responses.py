"""Catalogue rows -> JSON in the SDK's response shapes (`together.types.post_training`)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from trainer.checkpoint.store import INFERENCE, TRAINING, CheckpointRecord, ManifestFile
from trainer.contract.specs import ModelEntry
from trainer.serving.catalogue import OP_COMPLETED, OP_FAILED, OperationRow, ResourceRow, SessionRow
from trainer.serving.tenants import LOCAL_USER

GPU_TYPE = "B200-SXM"  # the only value the SDK's supported-models type admits; informative only


def iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, timezone.utc).isoformat().replace("+00:00", "Z")


def _error(error: dict[str, Any] | None) -> dict[str, Any] | None:
    if error is None:
        return None
    return {**error, "occurred_at": iso(error.get("occurred_at"))}


def _drop_none(value: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in value.items() if v is not None}


def resource_json(row: ResourceRow, details: dict[str, Any] | None = None) -> dict[str, Any]:
    """The SDK's `ModelResource`; `status_details` carries what serves its samples when the
    resource is live (`{"generator": {"backend", "replicas": [...]}}`)."""
    spec = row.spec
    compute = _drop_none(dict(spec.get("compute_config") or {}))
    compute.setdefault("num_generator_replicas", 1)
    return _drop_none(
        {
            "id": row.id,
            "base_model": spec["base_model"],
            "base_weights_ref": spec.get("base_weights_ref"),
            "compute_config": compute,
            "lora_enabled": bool(spec.get("lora_enabled", True)),
            "optimizer_config": spec.get("optimizer_config") or {"adam": {}},
            "inactive_timeout": int(spec.get("inactive_timeout", 3600)),
            "expires_at": iso(row.expires_at),
            "status": row.status,
            "status_details": details or {},
            "error": _error(row.error),
            "created_at": iso(row.created_at),
            "updated_at": iso(row.updated_at),
            "created_by": row.owner or LOCAL_USER,
        }
    )


def training_checkpoint_json(record: CheckpointRecord) -> dict[str, Any]:
    return {"id": record.id, "created_at": iso(record.created_at), "step": record.step}


def checkpoint_json(
    record: CheckpointRecord, files: list[ManifestFile] | None = None
) -> dict[str, Any]:
    """The SDK's `Checkpoint`, plus `files`: every file of the checkpoint with its manifest
    size and sha256 (the SDK's models keep extra fields)."""
    return _drop_none(
        {
            "id": record.id,
            "base_model": record.base_model,
            "created_at": iso(record.created_at),
            "session_id": record.session_id,
            "step": record.step,
            "type": record.type,
            "lora_rank": record.lora_rank,
            "files": None
            if files is None
            else [{"path": f.rel, "size": f.size, "sha256": f.sha256} for f in files],
        }
    )


def session_json(
    row: SessionRow,
    base_model: str,
    checkpoints: list[CheckpointRecord],
    live: tuple[int, dict[str, Any]] | None,
) -> dict[str, Any]:
    step, policy = live if live is not None else (row.step, row.policy_state)
    return _drop_none(
        {
            "id": row.id,
            "status": row.status,
            "base_model": base_model,
            "model_resources_id": row.resource_id,
            "created_at": iso(row.created_at),
            "updated_at": iso(row.updated_at),
            "created_by": row.owner or LOCAL_USER,
            "display_name": row.display_name,
            "metadata": row.metadata,
            "step": step,
            "policy_state": policy,
            "lora_config": row.lora_config,
            "resume_from_checkpoint_id": row.spec.get("resume_from_checkpoint_id"),
            "error": _error(row.error),
            "training_checkpoints": [
                training_checkpoint_json(c) for c in checkpoints if c.type == TRAINING
            ],
            "inference_checkpoints": [
                training_checkpoint_json(c) for c in checkpoints if c.type == INFERENCE
            ],
        }
    )


def operation_json(row: OperationRow) -> dict[str, Any]:
    out: dict[str, Any] = {"id": row.id, "status": row.status}
    if row.status == OP_COMPLETED:
        out["output"] = row.output if row.output is not None else {}
    elif row.status == OP_FAILED and row.error is not None:
        out["error"] = row.error
    return out


def supported_model_json(entry: ModelEntry) -> dict[str, Any]:
    return {
        "base_model": entry.name,
        "default_gpu_type": GPU_TYPE,
        "compute_configs": [
            {
                "gpu_type": GPU_TYPE,
                "generator_config": {
                    "context_length": entry.max_seq_length,
                    "sampling_defaults": {
                        "logprobs": 1,
                        "max_tokens": 100,
                        "n": 1,
                        "temperature": 1.0,
                    },
                },
                "trainer_config": {
                    "lora": {
                        "max_batch_size": entry.max_batch_size,
                        "max_rank": entry.max_lora_rank,
                        "max_seq_length": entry.max_seq_length,
                    },
                    "full": {
                        "max_batch_size": entry.max_batch_size,
                        "max_seq_length": entry.max_seq_length,
                    },
                },
            }
        ],
    }


def page_json(items: list[dict[str, Any]], has_more: bool, limit: int) -> dict[str, Any]:
    return {
        "data": items,
        "meta": {
            "has_more": has_more,
            "limit": limit,
            "next_cursor": items[-1]["id"] if has_more and items else "",
        },
    }
