"""Training runs, checkpoints and Tinker sessions, as the SDK's `RestClient` reads them.

A training run is a Tinker model, or an RL-session-API training session: the checkpoints of
both faces are listed here with their `tinker://` paths (`trainer.api.tinker.paths`), and a
sampler checkpoint downloads through signed URLs that point at the worker itself (the same
signed file route as the RL session API's downloads).
"""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool

from trainer.api.auth import principal_of
from trainer.api.http import FILE_PATH, sign_for
from trainer.api.tinker import paths
from trainer.api.tinker.bridge import TinkerBridge
from trainer.api.tinker.records import TinkerCheckpoint, TinkerModel, TinkerSampler, TinkerSession
from trainer.api.tinker.requests import CheckpointTtl
from trainer.api.tinker.routes import bridge_of, parse, session_owner
from trainer.api.tinker.routes import get_session as tinker_session
from trainer.checkpoint.export import stored_encrypted
from trainer.checkpoint.store import INFERENCE, CheckpointCorrupt, CheckpointRecord
from trainer.serving.catalogue import SessionRow
from trainer.serving.errors import ApiError, bad_request, not_found
from trainer.serving.ownership import owned, visible
from trainer.serving.responses import iso
from trainer.serving.tenants import LOCAL_USER, Principal

router = APIRouter()
TINKER_SESSION_PREFIX = "tinker "  # display name of the engine sessions this face opens


def _size(bridge: TinkerBridge, record: CheckpointRecord) -> int | None:
    try:
        return sum(f.size for f in bridge.worker.checkpoints.manifest_files(record.id))
    except (KeyError, CheckpointCorrupt):
        return None


def checkpoint_json(bridge: TinkerBridge, record: CheckpointRecord) -> dict[str, Any]:
    path = paths.path_of(bridge, record)
    _, kind, name = paths.parse(path, "tinker_path")
    saved = bridge.db.get(TinkerCheckpoint, path)
    return {
        "checkpoint_id": f"{paths.SEGMENTS[kind]}/{name}",
        "checkpoint_type": kind,
        "time": iso(record.created_at),
        "tinker_path": path,
        "size_bytes": _size(bridge, record),
        "public": saved.public if saved is not None else False,
        "user_metadata": saved.user_metadata if saved is not None else None,
        "expires_at": iso(saved.expires_at) if saved is not None else None,
    }


def run_checkpoints(bridge: TinkerBridge, run_id: str) -> list[CheckpointRecord]:
    """A run's checkpoints, newest first: those saved through Tinker under the run, or the
    RL session API's of the training session `run_id`."""
    # its tinker paths (a logical name, `names`, is another row of the same checkpoint)
    saved = bridge.db.select(TinkerCheckpoint, "run_id = ? AND scope IS NULL", (run_id,))
    records = [bridge.worker.checkpoints.get(c.checkpoint_id) for c in saved]
    if not saved:
        records = list(bridge.worker.checkpoints.list(session_id=run_id, limit=10_000))
    found = [r for r in records if r is not None]
    return sorted(found, key=lambda r: (r.created_at, r.id), reverse=True)


def run_owner(bridge: TinkerBridge, run_id: str) -> tuple[bool, str | None]:
    """Whether `run_id` is a run (a Tinker model or an RL-face session), and its owner."""
    model = bridge.db.get(TinkerModel, run_id)
    if model is not None:
        return True, session_owner(bridge, model.tinker_session)
    row = bridge.worker.store.get(SessionRow, run_id)
    return row is not None, row.owner if row is not None else None


def check_run(bridge: TinkerBridge, run_id: str, who: Principal) -> str | None:
    """The run's owner, when `who` may see the run; else the 404 of a missing run."""
    found, owner = run_owner(bridge, run_id)
    owned(
        run_id if found else None, who, "training run", run_id, "training_run_id", lambda _: owner
    )
    return owner


def run_json(bridge: TinkerBridge, run_id: str, who: Principal) -> dict[str, Any]:
    owner = check_run(bridge, run_id, who)
    model = bridge.db.get(TinkerModel, run_id)
    records = run_checkpoints(bridge, run_id)
    last = {
        kind: next((r for r in records if r.type == engine_type), None)
        for kind, engine_type in paths.ENGINE_TYPES.items()
    }
    rank: int | None
    if model is not None:
        base, rank, seen = model.base_model, model.lora_rank, model.last_request_at
        metadata = {k: str(v) for k, v in model.user_metadata.items()}
    else:
        row = bridge.worker.store.get(SessionRow, run_id)
        if row is None:
            raise not_found("training run", run_id, "training_run_id")
        base = _session_base_model(bridge, row)
        rank = (row.lora_config or {}).get("rank")
        seen, metadata = row.updated_at, None
    return {
        "training_run_id": run_id,
        "base_model": base,
        "model_owner": owner or LOCAL_USER,
        "is_lora": rank is not None,
        "corrupted": False,
        "lora_rank": rank,
        "last_request_time": iso(seen),
        "last_checkpoint": checkpoint_json(bridge, last["training"]) if last["training"] else None,
        "last_sampler_checkpoint": checkpoint_json(bridge, last["sampler"])
        if last["sampler"]
        else None,
        "user_metadata": metadata,
    }


def _session_base_model(bridge: TinkerBridge, row: SessionRow) -> str:
    from trainer.serving.catalogue import ResourceRow

    resource = bridge.worker.store.get(ResourceRow, row.resource_id)
    if resource is not None:
        return str(resource.spec.get("base_model"))
    # a run with no resource (a copy's, `routes_publish`): its checkpoints' base model
    held = bridge.worker.checkpoints.list(session_id=row.id, limit=1)
    return held[0].base_model if held else ""


def _page(limit: int, offset: int) -> None:
    if not 1 <= limit <= 1000:
        raise bad_request("limit: must be in [1, 1000]", "limit")
    if not 0 <= offset <= 1 << 31:  # SQLite integers are 64-bit; no listing is this long
        raise bad_request("offset: must be in [0, 2**31]", "offset")


@router.get("/training_runs")
async def list_training_runs(
    request: Request, limit: Annotated[int, Query()] = 20, offset: Annotated[int, Query()] = 0
) -> dict[str, Any]:
    _page(limit, offset)
    bridge = bridge_of(request)
    who = principal_of(request)

    def collect() -> dict[str, Any]:
        models = bridge.db.select(TinkerModel, tail="ORDER BY created_at DESC, id DESC")
        ids = [m.id for m in models if visible(who, session_owner(bridge, m.tinker_session))]
        where = None if who.admin else {"owner": who.user}
        rows, _ = bridge.worker.store.page(SessionRow, after=None, limit=10_000, where=where)
        ids += [
            r.id
            for r in sorted(rows, key=lambda r: (r.created_at, r.id), reverse=True)
            if not (r.display_name or "").startswith(TINKER_SESSION_PREFIX)
        ]
        page = ids[offset : offset + limit]
        return {
            "training_runs": [run_json(bridge, run_id, who) for run_id in page],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(ids)},
        }

    return await run_in_threadpool(collect)


@router.get("/training_runs/{run_id}")
async def get_training_run(request: Request, run_id: str) -> dict[str, Any]:
    return await run_in_threadpool(run_json, bridge_of(request), run_id, principal_of(request))


@router.get("/training_runs/{run_id}/checkpoints")
async def list_run_checkpoints(request: Request, run_id: str) -> dict[str, Any]:
    bridge = bridge_of(request)
    who = principal_of(request)

    def collect() -> dict[str, Any]:
        check_run(bridge, run_id, who)
        return {
            "checkpoints": [checkpoint_json(bridge, r) for r in run_checkpoints(bridge, run_id)]
        }

    return await run_in_threadpool(collect)


@router.get("/checkpoints")
async def list_user_checkpoints(
    request: Request, limit: Annotated[int, Query()] = 100, offset: Annotated[int, Query()] = 0
) -> dict[str, Any]:
    _page(limit, offset)
    bridge = bridge_of(request)
    who = principal_of(request)

    def collect() -> dict[str, Any]:
        store = bridge.worker.checkpoints
        mine = None if who.admin else bridge.worker.store.session_ids_of(who.user)
        records = list(store.list(limit=offset + limit, session_ids=mine))
        total = len(list(store.list(limit=1_000_000, session_ids=mine)))
        return {
            "checkpoints": [checkpoint_json(bridge, r) for r in records[offset:]],
            "cursor": {"offset": offset, "limit": limit, "total_count": total},
        }

    return await run_in_threadpool(collect)


def checkpoint_record(
    bridge: TinkerBridge, run_id: str, checkpoint_id: str, who: Principal, write: bool = False
) -> CheckpointRecord:
    """The checkpoint a run's route names: for a read, `who`'s own or a published one; for a
    `write` (delete, TTL, publish), `who`'s own only. Otherwise the 404 of a missing run or
    checkpoint, the same for "not there" and "not yours"."""
    path = f"{paths.PREFIX}{run_id}/{checkpoint_id}"
    if write or not paths.published(bridge, path):
        check_run(bridge, run_id, who)
    return paths.resolve(bridge, path, "checkpoint_id", who, write=write)


@router.get("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/external_weights_urls")
async def external_weights_urls(
    request: Request, run_id: str, checkpoint_id: str
) -> dict[str, Any]:
    """Signed URLs of an external (or sampler) checkpoint's adapter files, valid for the
    signer's TTL: adapter_config.json and adapter_model.safetensors (an external export's in
    Tinker's naming, `.age` when encrypted; a sampler checkpoint's in PEFT's)."""
    bridge = bridge_of(request)
    who = principal_of(request)
    record = await run_in_threadpool(checkpoint_record, bridge, run_id, checkpoint_id, who)
    if record.type != INFERENCE:
        raise bad_request(
            f"checkpoint_id: {checkpoint_id} is a training checkpoint (weights and optimizer "
            "state); save_weights_external writes the downloadable adapter",
            "checkpoint_id",
        )
    try:
        files = await run_in_threadpool(
            bridge.worker.checkpoints.variant_files, record.id, "ADAPTER"
        )
    except (KeyError, CheckpointCorrupt) as exc:
        raise ApiError(
            409, f"checkpoint_id: {checkpoint_id}: {exc}", param="checkpoint_id"
        ) from None
    urls = {
        f.name: sign_for(
            request,
            "GET",
            FILE_PATH.format(checkpoint_id=record.id, variant="ADAPTER", filename=f.name),
            who,
        )
        for f in files
    }
    return {"urls": urls, "expires": iso(time.time() + request.app.state.signer.ttl_s)}


@router.put("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/ttl")
async def set_checkpoint_ttl(request: Request, run_id: str, checkpoint_id: str) -> dict[str, Any]:
    """A Tinker checkpoint's expiry, from now (`ttl_seconds`; null: none): recorded and listed
    as `expires_at`, as a save's `ttl_seconds` is (nothing is deleted when it passes)."""
    body: CheckpointTtl = await parse(request, CheckpointTtl)
    bridge = bridge_of(request)
    who = principal_of(request)
    record = await run_in_threadpool(checkpoint_record, bridge, run_id, checkpoint_id, who, True)
    path = f"{paths.PREFIX}{run_id}/{checkpoint_id}"
    if bridge.db.get(TinkerCheckpoint, path) is None:
        raise bad_request(
            f"checkpoint_id: {record.id} was saved through the RL session API; it has no TTL",
            "checkpoint_id",
        )
    expires = None if body.ttl_seconds is None else time.time() + body.ttl_seconds
    await run_in_threadpool(bridge.db.update, TinkerCheckpoint, path, expires_at=expires)
    return {}


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
async def delete_checkpoint(request: Request, run_id: str, checkpoint_id: str) -> dict[str, Any]:
    """The Tinker name is forgotten; the checkpoint itself stays in the catalogue (the RL
    session API may still resume from it), except an encrypted export: nothing on the worker
    can read it, so its files go too."""
    bridge = bridge_of(request)
    who = principal_of(request)
    record = await run_in_threadpool(checkpoint_record, bridge, run_id, checkpoint_id, who, True)
    path = f"{paths.PREFIX}{run_id}/{checkpoint_id}"
    if bridge.db.get(TinkerCheckpoint, path) is None:
        raise bad_request(
            f"checkpoint_id: {record.id} was saved through the RL session API; it stays",
            "checkpoint_id",
        )
    store = bridge.worker.checkpoints

    def forget() -> None:
        encrypted = stored_encrypted(store, record.id)
        bridge.db.delete(TinkerCheckpoint, path)
        saved_as = (run_id, *checkpoint_id.split("/", 1))  # its logical name goes too
        kind = paths.KINDS.get(saved_as[1], "")
        for named in bridge.db.select(
            TinkerCheckpoint,
            "scope IS NOT NULL AND run_id = ? AND kind = ? AND name = ? AND checkpoint_id = ?",
            (run_id, kind, saved_as[-1], record.id),
        ):
            bridge.db.delete(TinkerCheckpoint, named.path)
        if encrypted and not bridge.db.select(TinkerCheckpoint, "checkpoint_id = ?", (record.id,)):
            store.delete(record.id)

    await run_in_threadpool(forget)
    return {}


@router.get("/sessions")
async def list_sessions(
    request: Request, limit: Annotated[int, Query()] = 20, offset: Annotated[int, Query()] = 0
) -> dict[str, Any]:
    _page(limit, offset)
    who = principal_of(request)
    rows = bridge_of(request).db.select(TinkerSession, tail="ORDER BY created_at DESC, id DESC")
    rows = [r for r in rows if visible(who, r.owner)]
    return {"sessions": [r.id for r in rows[offset : offset + limit]]}


@router.get("/sessions/{session_id}")
async def get_session(request: Request, session_id: str) -> dict[str, Any]:
    bridge = bridge_of(request)
    session = tinker_session(bridge, session_id, principal_of(request))
    return {
        "training_run_ids": [
            m.id for m in bridge.db.select(TinkerModel, "tinker_session = ?", (session_id,))
        ],
        "sampler_ids": [
            s.id for s in bridge.db.select(TinkerSampler, "tinker_session = ?", (session_id,))
        ],
        "user_metadata": {k: str(v) for k, v in session.user_metadata.items()},
        "display_name": session.display_name,
    }
