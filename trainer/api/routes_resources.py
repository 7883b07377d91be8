"""`/rl/supported-models`, `/rl/model-resources...` and `/rl/checkpoints...` (+ signed files)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse
from pydantic import ValidationError

from trainer.api.errors import ApiError, bad_request, from_pydantic, not_found
from trainer.api.requests import (
    CheckpointVariant,
    CreateResourceBody,
    ExtendExpiryBody,
    StopResourceBody,
)
from trainer.api.state import base_url, parse_limit, parse_statuses, verify_signed, worker_of
from trainer.api.store import ResourceRow
from trainer.api.wire import (
    checkpoint_json,
    page_json,
    resource_json,
    supported_model_json,
)
from trainer.checkpoints import INFERENCE, TRAINING

router = APIRouter()
files_router = APIRouter()

_RESOURCE_STATUSES = (
    "MODEL_RESOURCES_STATUS_PENDING",
    "MODEL_RESOURCES_STATUS_CREATING",
    "MODEL_RESOURCES_STATUS_READY",
    "MODEL_RESOURCES_STATUS_ERROR",
    "MODEL_RESOURCES_STATUS_STOPPED",
    "MODEL_RESOURCES_STATUS_STOPPING",
)
FILE_PATH = "/v1/rl/files/checkpoints/{checkpoint_id}/{variant}/{filename}"


@router.get("/rl/supported-models")
async def supported_models(request: Request) -> dict[str, Any]:
    worker = worker_of(request)
    return {"data": [supported_model_json(m) for m in worker.config.models]}


@router.post("/rl/model-resources")
async def create_resource(request: Request, body: CreateResourceBody) -> dict[str, Any]:
    return resource_json(worker_of(request).create_resource(body))


@router.post("/rl/model-resources/estimate-cost")
async def estimate_cost(request: Request, body: CreateResourceBody) -> dict[str, Any]:
    if worker_of(request).config.model(body.base_model) is None:
        raise bad_request(f"base_model: {body.base_model!r} is not served", "base_model")
    return {"currency": "USD", "price_per_hour": 0.0}


@router.get("/rl/model-resources")
async def list_resources(
    request: Request,
    after: str | None = None,
    created_by: str | None = None,
    limit: str | None = None,
) -> dict[str, Any]:
    worker = worker_of(request)
    size = parse_limit(limit)
    statuses = parse_statuses(request, _RESOURCE_STATUSES)
    if created_by not in (None, "", "me", "local"):
        return page_json([], False, size)
    rows, more = worker.store.page(ResourceRow, after=after, limit=size, statuses=statuses)
    return page_json([resource_json(r) for r in rows], more, size)


@router.get("/rl/model-resources/{model_resources_id}")
async def get_resource(request: Request, model_resources_id: str) -> dict[str, Any]:
    return resource_json(worker_of(request).resource(model_resources_id))


@router.post("/rl/model-resources/{model_resources_id}/extend-expiry")
async def extend_expiry(
    request: Request, model_resources_id: str, body: ExtendExpiryBody
) -> dict[str, Any]:
    return resource_json(worker_of(request).extend_expiry(model_resources_id, body.seconds))


@router.post("/rl/model-resources/{model_resources_id}/stop")
async def stop_resource(
    request: Request,
    model_resources_id: str,
    force: bool | None = None,
    body: Annotated[dict[str, Any] | None, Body()] = None,
) -> dict[str, Any]:
    """`force` comes as a query parameter from the SDK, or in the body per the contract."""
    try:
        parsed = StopResourceBody.model_validate(body or {})
    except ValidationError as exc:
        raise from_pydantic(exc) from None
    worker = worker_of(request)
    row = await run_in_threadpool(
        worker.stop_resource, model_resources_id, bool(force) or parsed.force
    )
    return resource_json(row)


# -- checkpoints ---------------------------------------------------------------------------


@router.get("/rl/checkpoints")
async def list_checkpoints(
    request: Request,
    after: str | None = None,
    base_model: str | None = None,
    limit: str | None = None,
    session_id: str | None = None,
    type: str | None = None,
) -> dict[str, Any]:
    size = parse_limit(limit)
    if type not in (None, "", TRAINING, INFERENCE):
        raise bad_request(f"type: must be {TRAINING} or {INFERENCE}, got {type!r}", "type")
    records = worker_of(request).checkpoints.list(
        session_id=session_id or None,
        type=type or None,
        base_model=base_model or None,
        after=after or None,
        limit=size + 1,
    )
    return page_json([checkpoint_json(r) for r in records[:size]], len(records) > size, size)


@router.get("/rl/checkpoints/{checkpoint_id}")
async def get_checkpoint(request: Request, checkpoint_id: str) -> dict[str, Any]:
    record = worker_of(request).checkpoints.get(checkpoint_id)
    if record is None:
        raise not_found("checkpoint", checkpoint_id, "checkpoint_id")
    return checkpoint_json(record)


@router.get("/rl/checkpoints/{checkpoint_id}/download")
async def download_checkpoint(
    request: Request, checkpoint_id: str, variant: Annotated[str | None, Query()] = None
) -> dict[str, Any]:
    worker = worker_of(request)
    allowed = CheckpointVariant.__args__  # type: ignore[attr-defined]
    if variant not in allowed:
        raise bad_request(f"variant: required, one of {list(allowed)}; got {variant!r}", "variant")
    if worker.checkpoints.get(checkpoint_id) is None:
        raise not_found("checkpoint", checkpoint_id, "checkpoint_id")
    short = str(variant).removeprefix("CHECKPOINT_VARIANT_")
    try:
        files = worker.checkpoints.files(checkpoint_id, short)
    except KeyError:
        raise bad_request(
            f"variant: checkpoint {checkpoint_id} has no {variant} files (ADAPTER exists for "
            "LoRA checkpoints only)",
            "variant",
        ) from None
    signer = request.app.state.signer
    data = []
    for filename, path in files:
        if "/" in filename:
            raise ApiError(400, f"checkpoint file {filename!r} is nested", code="unsupported")
        url_path = FILE_PATH.format(checkpoint_id=checkpoint_id, variant=short, filename=filename)
        data.append(
            {
                "filename": filename,
                "size": path.stat().st_size,
                "url": signer.sign(base_url(request), "GET", url_path),
            }
        )
    return {"data": data}


@files_router.get(FILE_PATH)
async def checkpoint_file(
    request: Request, checkpoint_id: str, variant: str, filename: str
) -> FileResponse:
    """Served without a token: the signature in the query string is the credential."""
    verify_signed(request, "GET")
    try:
        files = dict(worker_of(request).checkpoints.files(checkpoint_id, variant))
    except KeyError:
        raise not_found(
            "checkpoint file", f"{checkpoint_id}/{variant}/{filename}", "filename"
        ) from None
    path = files.get(filename)
    if path is None:
        raise not_found("checkpoint file", f"{checkpoint_id}/{variant}/{filename}", "filename")
    return FileResponse(path, media_type="application/octet-stream", filename=filename)
