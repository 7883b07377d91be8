"""`/rl/training-sessions...`: create, list, get, patch, stop, and payload URLs."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse
from pydantic import ValidationError

from trainer.api.auth import principal_of
from trainer.api.http import (
    json_object,
    listed_rows,
    sign_for,
    verify_signed,
    worker_of,
)
from trainer.contract.errors import OperationError
from trainer.serving.catalogue import SES_LIVE, ResourceRow, SessionRow
from trainer.serving.errors import (
    ApiError,
    bad_request,
    failed_precondition,
    from_pydantic,
    not_found,
)
from trainer.serving.requests import CreateSessionBody, UpdateSessionBody
from trainer.serving.responses import page_json, session_json
from trainer.serving.tenants import Principal, over_quota
from trainer.serving.worker import Worker

router = APIRouter()
files_router = APIRouter()

_SESSION_STATUSES = (
    "TRAINING_SESSION_STATUS_CREATING",
    "TRAINING_SESSION_STATUS_RUNNING",
    "TRAINING_SESSION_STATUS_STOPPED",
    "TRAINING_SESSION_STATUS_STOPPING",
    "TRAINING_SESSION_STATUS_ERROR",
    "TRAINING_SESSION_STATUS_EXPIRED",
)
PAYLOAD_PATH = "/v1/rl/payloads/{session_id}/{payload_id}"


async def render(worker: Worker, row: SessionRow) -> dict[str, Any]:
    resource = worker.store.get(ResourceRow, row.resource_id)
    base_model = resource.spec["base_model"] if resource is not None else ""
    checkpoints = worker.checkpoints.list(session_id=row.id, limit=100_000, oldest_first=True)
    live = await run_in_threadpool(worker.live_policy, row.id)
    return session_json(row, base_model, checkpoints, live)


@router.post("/rl/training-sessions")
async def create_session(request: Request, body: CreateSessionBody) -> dict[str, Any]:
    worker = worker_of(request)
    session_id, future = worker.create_session(body, who=principal_of(request))
    try:
        row = await asyncio.wait_for(
            asyncio.shield(asyncio.wrap_future(future)), worker.config.session_create_wait_s
        )
    except asyncio.TimeoutError:  # still opening: the client polls until RUNNING
        row = worker.session(session_id)
    except OperationError as exc:
        raise bad_request(exc.message, exc.field) from None
    return await render(worker, row)


@router.get("/rl/training-sessions")
async def list_sessions(
    request: Request,
    after: str | None = None,
    created_by: str | None = None,
    limit: str | None = None,
    model_resources_id: str | None = None,
) -> dict[str, Any]:
    where = {"resource_id": model_resources_id} if model_resources_id else {}
    rows, more, size = listed_rows(
        request, SessionRow, _SESSION_STATUSES, after, created_by, limit, where
    )
    worker = worker_of(request)
    return page_json([await render(worker, r) for r in rows], more, size)


@router.get("/rl/training-sessions/{session_id}")
async def get_session(request: Request, session_id: str) -> dict[str, Any]:
    worker = worker_of(request)
    return await render(worker, worker.session(session_id, principal_of(request)))


@router.patch("/rl/training-sessions/{session_id}")
async def update_session(request: Request, session_id: str) -> dict[str, Any]:
    worker = worker_of(request)
    worker.session(session_id, principal_of(request))
    raw = await json_object(request, worker.config.max_body_bytes)
    try:
        body = UpdateSessionBody.model_validate(raw)
    except ValidationError as exc:  # unknown metadata keys included: the SDK has no others
        raise from_pydantic(exc) from None
    # only what the client set: omitted fields stay, "" clears (overlay_metadata)
    metadata = body.metadata.model_dump(exclude_unset=True) if body.metadata else None
    row = worker.update_session(session_id, body.display_name, metadata)
    return await render(worker, row)


@router.post("/rl/training-sessions/{session_id}/stop")
async def stop_session(request: Request, session_id: str) -> dict[str, Any]:
    worker = worker_of(request)
    worker.session(session_id, principal_of(request))
    row = await run_in_threadpool(worker.stop_session, session_id)
    return await render(worker, row)


# -- payloads ------------------------------------------------------------------------------


@router.post("/rl/training-sessions/{session_id}/payloads/upload-url")
async def upload_url(request: Request, session_id: str) -> dict[str, str]:
    worker = worker_of(request)
    who = principal_of(request)
    worker.session(session_id, who)
    payload_id = worker.payloads.new_id()
    path = PAYLOAD_PATH.format(session_id=session_id, payload_id=payload_id)
    return {"payload_id": payload_id, "upload_url": sign_for(request, "PUT", path, who)}


@router.post("/rl/training-sessions/{session_id}/payloads/{payload_id}/download-url")
async def download_url(request: Request, session_id: str, payload_id: str) -> dict[str, str]:
    worker = worker_of(request)
    who = principal_of(request)
    worker.session(session_id, who)
    if not worker.payloads.path(session_id, payload_id).is_file():
        raise not_found("payload", payload_id, "payload_id")
    path = PAYLOAD_PATH.format(session_id=session_id, payload_id=payload_id)
    return {"download_url": sign_for(request, "GET", path, who)}


def _verify(request: Request, method: str, session_id: str) -> Principal | None:
    """The signature, then the session's owner against the user the URL was issued to (another
    user's session: the 404 of a missing one)."""
    issued_to = verify_signed(request, method)
    worker_of(request).session(session_id, issued_to)
    return issued_to


@files_router.put(PAYLOAD_PATH)
async def put_payload(request: Request, session_id: str, payload_id: str) -> dict[str, Any]:
    _verify(request, "PUT", session_id)
    worker = worker_of(request)
    status = worker.session(session_id).status
    if status not in SES_LIVE:  # its payloads were deleted when it stopped: keep it that way
        raise failed_precondition(
            f"session_id: session {session_id} is {status}; it takes no more payloads",
            "session_id",
        )
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > worker.payloads.max_bytes:
        raise ApiError(413, f"payload exceeds {worker.payloads.max_bytes} bytes", code="too_large")
    size = await worker.payloads.write_stream(session_id, payload_id, request.stream())
    owner = worker.session(session_id).owner
    limit = worker.storage_quota(owner)
    if limit is not None and owner is not None:
        used = await run_in_threadpool(worker.storage_used, owner)
        if used > limit:  # undone: the payload would pass its owner's storage quota
            worker.payloads.path(session_id, payload_id).unlink(missing_ok=True)
            raise over_quota("max_storage_bytes", limit, used, " bytes")
    return {"payload_id": payload_id, "size": size}


@files_router.get(PAYLOAD_PATH)
async def get_payload(request: Request, session_id: str, payload_id: str) -> FileResponse:
    _verify(request, "GET", session_id)
    path = worker_of(request).payloads.path(session_id, payload_id)
    if not path.is_file():
        raise not_found("payload", payload_id, "payload_id")
    return FileResponse(path, media_type="application/json")
