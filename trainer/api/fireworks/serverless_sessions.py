"""A serverless training session on the control plane (`/v1/accounts/{a}/trainingSessions/...`):
what the SDK's `FireworksClient` calls on it (`list_training_session_checkpoints`,
`promote_session_checkpoint`, `delete_training_session`; the cookbook's
`training/utils/serverless.py` lists and promotes through them).

A session's checkpoints are the logical names its run-scoped models saved (`save_state`,
`save_weights_for_sampler`: the name spaces `serverless.run_scope`), oldest first, each named
`accounts/<a>/trainingSessions/<ts>/checkpoints/<run id>-<name>` (the cookbook reads the run id
off that prefix) and typed as a job's are (`catalog`): `..._TRAINING_LORA` (resumable) or
`..._INFERENCE_LORA` (promotable; `..._INFERENCE_BASE` when saved `merged_base`). Promotion
records a model `accounts/<a>/models/<m>` serving the checkpoint's adapter (or its merged
model), as a job's does. Deleting the session ends it now: its models' engine
sessions close, its checkpoints stay. An account that is not the caller's, or a session of
another account, answers as a missing one.
"""

from __future__ import annotations

import json
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import ValidationError

from trainer.api.fireworks import serverless
from trainer.api.fireworks.bodies import PromoteBody, rfc3339
from trainer.api.fireworks.catalog import (
    TRAINING_LORA,
    JobCheckpoint,
    inference_type,
    output_model_id,
)
from trainer.api.fireworks.routes_jobs import BODY_MAX, account_of, face_of, page, page_args
from trainer.api.tinker import names
from trainer.api.tinker.bridge import TinkerBridge
from trainer.api.tinker.records import TinkerCheckpoint, TinkerModel, TinkerSession
from trainer.checkpoint.export import stored_encrypted
from trainer.checkpoint.store import INFERENCE
from trainer.serving.errors import bad_request, from_pydantic, not_found
from trainer.serving.tenants import Principal

router = APIRouter()
SESSIONS = "/v1/accounts/{account}/trainingSessions/{session_id}"
FIELD = "name"


def session_name(account: str, session_id: str) -> str:
    return f"accounts/{account}/trainingSessions/{session_id}"


def find_session(bridge: TinkerBridge, who: Principal, session_id: str) -> TinkerSession:
    """A serverless session of `who`'s (`serverless.session_of`); another's, or a plain
    Tinker session, is the 404 of a missing one."""
    found = serverless.session_of(bridge.db, who, session_id)
    if found is None:
        raise not_found("training session", session_name(who.user, session_id), FIELD)
    return found


def session_checkpoints(
    bridge: TinkerBridge, who: Principal, session_id: str
) -> list[tuple[str, TinkerCheckpoint]]:
    """(checkpoint id `<run id>-<name>`, its logical name's row) of a session, oldest first."""
    prefix = serverless.session_scope(names.account_of(who, None), session_id)
    rows = bridge.db.select(
        TinkerCheckpoint, "scope IS NOT NULL AND substr(scope, 1, ?) = ?", (len(prefix), prefix)
    )
    out = []
    for row in sorted(rows, key=lambda r: r.created_at):
        run = row.path.split("/")[1]
        out.append((f"{run}-{row.name}", row))
    return out


def _checkpoint(bridge: TinkerBridge, name: str, row: TinkerCheckpoint) -> JobCheckpoint | None:
    store = bridge.worker.checkpoints
    record = store.get(row.checkpoint_id)
    if record is None:
        return None
    if record.type == INFERENCE:
        kind = inference_type(record, row.merged)
        return JobCheckpoint(name, record, kind, not stored_encrypted(store, record.id))
    return JobCheckpoint(name, record, TRAINING_LORA, False)


def _row(account: str, session_id: str, found: JobCheckpoint) -> dict[str, Any]:
    return {
        "name": f"{session_name(account, session_id)}/checkpoints/{found.name}",
        "createTime": rfc3339(found.record.created_at),
        "updateTime": rfc3339(found.record.created_at),
        "checkpointType": found.type,
        "promotable": found.promotable,
        "step": found.record.step,
    }


@router.get(f"{SESSIONS}/checkpoints")
async def list_checkpoints(request: Request, account: str, session_id: str) -> dict[str, Any]:
    """Oldest first; `pageSize` (at most 200) and `pageToken`."""
    who = account_of(request, account)
    size, offset = page_args(request, default=200)
    bridge = face_of(request).bridge

    def read() -> list[dict[str, Any]]:
        find_session(bridge, who, session_id)
        found = [_checkpoint(bridge, n, r) for n, r in session_checkpoints(bridge, who, session_id)]
        return [_row(account, session_id, f) for f in found if f is not None]

    rows = await run_in_threadpool(read)
    chunk, token = page(rows, size, offset)
    return {"checkpoints": chunk, "nextPageToken": token, "totalSize": len(rows)}


@router.post(SESSIONS + "/checkpoints/{checkpoint}:promote")
async def promote(
    request: Request, account: str, session_id: str, checkpoint: str
) -> dict[str, Any]:
    """`{output_model, base_model}` (the SDK's `promote_session_checkpoint`): the model, at
    once."""
    who = account_of(request, account)
    raw = await request.body()
    if len(raw) > BODY_MAX:
        raise bad_request(f"body: more than {BODY_MAX} bytes", "body")
    try:
        body = PromoteBody.model_validate(json.loads(raw or b"{}"))
    except ValidationError as exc:
        raise from_pydantic(exc) from None
    except ValueError as exc:
        raise bad_request(
            f"request body is not valid JSON: {exc}", "body", "invalid_json"
        ) from None
    face = face_of(request)
    bridge = face.bridge

    def run() -> dict[str, Any]:
        find_session(bridge, who, session_id)
        model_id = output_model_id(who, body)
        rows = dict(session_checkpoints(bridge, who, session_id))
        found = _checkpoint(bridge, checkpoint, rows[checkpoint]) if checkpoint in rows else None
        if found is None:
            raise not_found("checkpoint", checkpoint, "checkpoint")
        if not found.promotable:
            raise bad_request(
                f"checkpoint: {checkpoint!r} is a {found.type} checkpoint, which is not "
                "promotable (save_weights_for_sampler writes promotable ones)",
                "checkpoint",
            )
        owner = session_name(who.user, session_id)
        model = face.catalog.record_model(who, model_id, found, owner, body.output_model)
        entry = face.catalog.catalogue_model(model.base_model)
        assert entry is not None  # a checkpoint's base model is the catalogue's
        name = f"accounts/{model.account}/models/{model.id}"
        return face.catalog.model_json(name, entry, model)

    return {"model": await run_in_threadpool(run)}


@router.delete(SESSIONS)
async def delete_session(request: Request, account: str, session_id: str) -> dict[str, Any]:
    """End the session now (its models' engine sessions close; checkpoints stay). A session
    already ended answers as before: the SDK deletes idempotently."""
    who = account_of(request, account)
    bridge = face_of(request).bridge

    def end() -> None:
        session = find_session(bridge, who, session_id)
        if session.ended_at is None:
            bridge.db.update(TinkerSession, session.id, ended_at=time.time())
        for model in bridge.db.select(TinkerModel, "tinker_session = ?", (session.id,)):
            bridge.release(model)

    await run_in_threadpool(end)
    return {}
