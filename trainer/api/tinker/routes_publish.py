"""Publish, unpublish and copy checkpoints (tinker 0.38's `RestClient.copy_weights`,
`publish_checkpoint_from_tinker_path`, `unpublish_checkpoint_from_tinker_path`).

- **Publish** (`POST .../checkpoints/{checkpoint_id}/publish`): a checkpoint saved through the
  Tinker API becomes readable by every user of the worker: sampled (`model_path`), loaded
  (`load_state`, `create_training_client_from_state`), described (`weights_info`), downloaded
  (`external_weights_urls`, the signed file route) and copied. Writes stay its owner's: only
  the owner publishes, unpublishes, deletes it or sets its TTL; anyone else's write answers
  as a missing checkpoint (the SDK documents 404 for "not found or not owned"). Publishing a
  public one, or unpublishing a private one, succeeds and changes nothing: the SDK documents a
  409 there, but its `execute_with_retries` retries a 409 for minutes, so a retry whose first
  try's answer was lost would hang and then fail a call that succeeded. An RL session API
  checkpoint has no Tinker record to carry the flag: a 400. Another user's published
  checkpoint is not listed among the caller's own checkpoints.
- **Unpublish** (`DELETE .../publish`): owner-only again; a signed URL issued meanwhile to
  another user stops working (the file route checks again when it is fetched).
- **Copy** (`POST /copy_weights`): the caller's new checkpoint, of the same kind, weights and
  name, under a new training run of the caller that cannot be trained on (a stopped session:
  the SDK's "new training run"). Its files are hard links to the source's (a copy where the
  file system cannot link), so no bytes are duplicated and deleting the source leaves the copy
  whole. The source is one the caller may read: its own, or a published one. The worker has
  no projects: `destination_project_id` is accepted and the copy is the caller's; a
  `session_id` must be the caller's Tinker session. `ttl_seconds` is the copy's own expiry
  (the source's is not inherited). The SDK's `X-Idempotency-Key` makes a retry answer the
  same copy. `weights_access_token` is refused: on this worker another user's checkpoint is
  readable once published, with no token.

Each of these is a POST or DELETE, so the audit trail records it (`trainer.api.audit`).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import Field, model_validator

from trainer.api.auth import principal_of
from trainer.api.tinker import paths
from trainer.api.tinker.bridge import TinkerBridge
from trainer.api.tinker.identity import RequestKey, request_key
from trainer.api.tinker.records import DONE, PENDING, TinkerCheckpoint, TinkerFuture
from trainer.api.tinker.routes import bridge_of, get_session, parse
from trainer.api.tinker.routes_runs import checkpoint_record
from trainer.checkpoint.store import CheckpointCorrupt, CheckpointRecord
from trainer.contract.specs import Spec
from trainer.serving.catalogue import SES_STOPPED, SessionRow
from trainer.serving.errors import ApiError, bad_request
from trainer.serving.tenants import Principal, over_quota

router = APIRouter()
PUBLISH = "/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish"
TOKEN_HEADER = "X-Tinker-Weights-Access-Token"
TTL_MIN, TTL_MAX = 3600, 10 * 365 * 86400  # the SDK's bounds: 1 hour to 10 years
COPY_WAIT_S = 120.0  # a retry waits this long for the copy its first try is making
_flags = threading.Lock()  # publish and unpublish: read, check and write as one


class CopyWeights(Spec):
    """tinker 0.38 `types.CopyWeightsRequest`."""

    source_path: str = Field(min_length=1, max_length=4096)
    destination_project_id: str | None = Field(default=None, max_length=256)
    session_id: str | None = Field(default=None, max_length=256)
    model_seq_id: int | None = Field(default=None, ge=0)
    ttl_seconds: int | None = Field(default=None, ge=TTL_MIN, le=TTL_MAX)
    weights_access_token: str | None = None

    @model_validator(mode="after")
    def _destination(self) -> CopyWeights:
        if (self.session_id is None) != (self.model_seq_id is None):
            raise ValueError("session_id: give it together with model_seq_id, or neither")
        if self.session_id is None and not self.destination_project_id:
            raise ValueError(
                "destination_project_id: required unless session_id and model_seq_id are given"
            )
        return self


# -- publish / unpublish ---------------------------------------------------------------------


def _set_public(
    bridge: TinkerBridge, run_id: str, checkpoint_id: str, who: Principal, public: bool
) -> None:
    """Publish (or unpublish) `who`'s own checkpoint; another user's is missing (404)."""
    record = checkpoint_record(bridge, run_id, checkpoint_id, who, write=True)
    path = f"{paths.PREFIX}{run_id}/{checkpoint_id}"
    with _flags:
        saved = bridge.db.get(TinkerCheckpoint, path)
        if saved is None:
            raise bad_request(
                f"checkpoint_id: {record.id} was saved through the RL session API; only a "
                "checkpoint saved through the Tinker API is published",
                "checkpoint_id",
            )
        if saved.public != public:  # already so: done (see the module docstring)
            bridge.db.update(TinkerCheckpoint, path, public=public)


@router.post(PUBLISH)
async def publish_checkpoint(request: Request, run_id: str, checkpoint_id: str) -> dict[str, Any]:
    bridge, who = bridge_of(request), principal_of(request)
    await run_in_threadpool(_set_public, bridge, run_id, checkpoint_id, who, True)
    return {}


@router.delete(PUBLISH)
async def unpublish_checkpoint(request: Request, run_id: str, checkpoint_id: str) -> dict[str, Any]:
    bridge, who = bridge_of(request), principal_of(request)
    await run_in_threadpool(_set_public, bridge, run_id, checkpoint_id, who, False)
    return {}


# -- copy_weights ----------------------------------------------------------------------------


def _link_files(source: Path, manifest: dict[str, Any]) -> Any:
    """A `CheckpointStore.write` writer: each file of the source's manifest, hard-linked (copied
    where the file system cannot link) under the same relative path."""

    def write(into: Path) -> None:
        for rel in sorted(manifest["files"]):
            target = into / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(source / rel, target)
            except OSError:
                shutil.copy2(source / rel, target)

    return write


def _copy(
    bridge: TinkerBridge,
    record: CheckpointRecord,
    source_path: str,
    who: Principal,
    ttl: int | None,
) -> str:
    """The caller's copy of `record` (readable by `who`): a new stopped session of `who` holds
    it, recorded under the source's kind and name; its tinker path. The caller's
    `max_storage_bytes` counts the copy's bytes, as for any checkpoint of theirs."""
    worker = bridge.worker
    _, kind, name = paths.parse(source_path, "source_path")
    try:
        manifest = worker.checkpoints.manifest(record.id)
    except (KeyError, CheckpointCorrupt) as exc:
        raise bad_request(f"source_path: {source_path}: {exc}", "source_path") from None
    limit = worker.storage_quota(who.user)
    if limit is not None:
        used = worker.storage_used(who.user)
        size = sum(int(f["size"]) for f in manifest["files"].values())
        if used + size > limit:
            raise over_quota("max_storage_bytes", limit, used + size, " bytes")
    now = time.time()
    run = SessionRow(
        id=f"ts_{uuid.uuid4().hex}",
        resource_id="",  # none: the run cannot be trained on
        spec={},
        status=SES_STOPPED,
        created_at=now,
        updated_at=now,
        display_name=f"copy of {source_path}"[:128],
        owner=who.user,
    )
    copy = worker.checkpoints.write(
        type=record.type,
        session_id=run.id,
        step=record.step,
        base_model=record.base_model,
        lora_rank=record.lora_rank,
        writer=_link_files(record.path, manifest),
        meta=manifest.get("meta") or {},
    )
    path = paths.make(run.id, kind, name)
    try:
        worker.store.insert(run)
        bridge.db.insert(
            TinkerCheckpoint(
                path=path,
                run_id=run.id,
                kind=kind,
                name=name,
                checkpoint_id=copy.id,
                created_at=copy.created_at,
                expires_at=None if ttl is None else now + ttl,
            )
        )
    except BaseException:
        worker.checkpoints.delete(copy.id)
        raise
    return path


def _settled(bridge: TinkerBridge, request_id: str) -> TinkerFuture | None:
    """The future of a copy another try of the same request is making, once it settles."""
    deadline = time.monotonic() + COPY_WAIT_S
    while time.monotonic() < deadline:
        found = bridge.lookup(request_id)
        if found is None or found.status != PENDING:
            return found
        time.sleep(0.05)
    return None


def _copy_once(
    bridge: TinkerBridge, body: CopyWeights, who: Principal, key: RequestKey
) -> dict[str, Any]:
    """The copy `body` asks for, once per request identity (`X-Idempotency-Key`)."""
    if body.session_id is not None:
        get_session(bridge, body.session_id, who)  # the caller's (another's: missing)
    record = paths.resolve(bridge, body.source_path, "source_path", who)
    future, new = bridge.future(f"copy:{who.user}", "CopyWeights", key, who.user)
    if not new:
        done = _settled(bridge, future.id)
        if done is not None and done.status == DONE and done.result is not None:
            return done.result
        # (the SDK retries a 409 under the same key: it finds the copy once made, or, when
        # the first try failed and forgot its future, makes it)
        raise ApiError(
            409,
            "X-Idempotency-Key: the first try of this copy has not finished; retry",
            param="X-Idempotency-Key",
        )
    try:
        result = {"tinker_path": _copy(bridge, record, body.source_path, who, body.ttl_seconds)}
    except BaseException:
        bridge.db.delete(TinkerFuture, future.id)  # a retry runs it again
        raise
    bridge.finish(future.id, result)
    return result


@router.post("/copy_weights")
async def copy_weights(request: Request) -> dict[str, Any]:
    body: CopyWeights = await parse(request, CopyWeights)
    if body.weights_access_token is not None or request.headers.get(TOKEN_HEADER) is not None:
        raise bad_request(
            "weights_access_token: not used by this worker: another user's checkpoint is "
            "readable once its owner publishes it (publish_checkpoint_from_tinker_path)",
            "weights_access_token",
        )
    bridge, who = bridge_of(request), principal_of(request)
    key = request_key(request, f"copy:{who.user}", "CopyWeights", None, body)
    return await run_in_threadpool(_copy_once, bridge, body, who, key)
