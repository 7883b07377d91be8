"""`/rl/supported-models`, `/rl/model-resources...` and `/rl/checkpoints...` (+ signed files)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Annotated, Any

from fastapi import APIRouter, Body, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse
from pydantic import ValidationError

from trainer.api.auth import principal_of
from trainer.api.http import (
    FILE_PATH,
    listed_rows,
    parse_limit,
    sign_for,
    verify_signed,
    worker_of,
)
from trainer.checkpoint.export import stored_export
from trainer.checkpoint.store import (
    INFERENCE,
    TRAINING,
    CheckpointCorrupt,
    CheckpointRecord,
    CheckpointStore,
)
from trainer.contract.specs import ResourceSpec
from trainer.serving.catalogue import ResourceRow
from trainer.serving.errors import (
    ApiError,
    bad_request,
    failed_precondition,
    from_pydantic,
    not_found,
)
from trainer.serving.ownership import owned, usable_cursor
from trainer.serving.requests import (
    CreateResourceBody,
    ExtendExpiryBody,
    StopResourceBody,
)
from trainer.serving.responses import (
    checkpoint_json,
    page_json,
    resource_json,
    supported_model_json,
)

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


@router.get("/rl/supported-models")
async def supported_models(request: Request) -> dict[str, Any]:
    worker = worker_of(request)
    return {"data": [supported_model_json(m) for m in worker.config.models]}


@router.post("/rl/model-resources")
async def create_resource(request: Request, body: CreateResourceBody) -> dict[str, Any]:
    """Answers once the model has loaded (READY or ERROR), or after `resource_create_wait_s`
    (then CREATING, and the client polls): the SDK's first poll then sees READY, not a 10 s
    wait."""
    worker = worker_of(request)
    who = principal_of(request)
    spec = ResourceSpec.model_validate(body.model_dump(exclude={"shared"}))
    row = worker.create_resource(spec, who=who, shared=body.shared)
    loaded = worker.resource_loaded(row.id)
    if loaded is not None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(
                asyncio.shield(asyncio.wrap_future(loaded)), worker.config.resource_create_wait_s
            )
    return resource_json(worker.resource(row.id), worker.generator_details(row.id))


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
    rows, more, size = listed_rows(
        request,
        ResourceRow,
        _RESOURCE_STATUSES,
        after,
        created_by,
        limit,
        shared=lambda r: r.shared,
    )
    return page_json([resource_json(r) for r in rows], more, size)


@router.get("/rl/model-resources/{model_resources_id}")
async def get_resource(request: Request, model_resources_id: str) -> dict[str, Any]:
    worker = worker_of(request)
    row = worker.resource(model_resources_id, principal_of(request))
    return resource_json(row, worker.generator_details(model_resources_id))


@router.post("/rl/model-resources/{model_resources_id}/extend-expiry")
async def extend_expiry(
    request: Request, model_resources_id: str, body: ExtendExpiryBody
) -> dict[str, Any]:
    worker = worker_of(request)
    return resource_json(
        worker.extend_expiry(model_resources_id, body.seconds, principal_of(request))
    )


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
        worker.stop_resource, model_resources_id, bool(force) or parsed.force, principal_of(request)
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
    """Newest first, ties broken by id; `after` (the previous page's `next_cursor`, the id of
    its last checkpoint) continues strictly past that checkpoint, so checkpoints created
    between pages neither shift nor repeat items (docs/semantics.md §11)."""
    size = parse_limit(limit)
    if type not in (None, "", TRAINING, INFERENCE):
        raise bad_request(f"type: must be {TRAINING} or {INFERENCE}, got {type!r}", "type")
    worker = worker_of(request)
    store = worker.checkpoints
    who = principal_of(request)
    try:
        if after:  # a cursor of another user's checkpoint is unknown here too
            found = store.get(after)
            if not usable_cursor(found, who, owner=worker.checkpoint_owner):
                raise KeyError(after)
        records = store.list(
            session_id=session_id or None,
            type=type or None,
            base_model=base_model or None,
            after=after or None,
            limit=size + 1,
            session_ids=None if who.admin else worker.store.session_ids_of(who.user),
        )
    except KeyError:
        raise bad_request(
            f"after: no checkpoint {after!r}; the cursor is the id of the last checkpoint of the "
            "previous page (its meta.next_cursor)",
            "after",
        ) from None
    items = await run_in_threadpool(lambda: [_checkpoint_view(store, r) for r in records[:size]])
    return page_json(items, len(records) > size, size)


@router.get("/rl/checkpoints/{checkpoint_id}")
async def get_checkpoint(request: Request, checkpoint_id: str) -> dict[str, Any]:
    worker = worker_of(request)
    record = worker.checkpoint(checkpoint_id, principal_of(request), "checkpoint_id")
    return await run_in_threadpool(_checkpoint_view, worker.checkpoints, record)


def _checkpoint_view(store: CheckpointStore, record: CheckpointRecord) -> dict[str, Any]:
    """The checkpoint with its manifest's files (path, size, sha256); without them when the
    manifest cannot be read (then downloads and resumes refuse it with the reason)."""
    try:
        files = store.manifest_files(record.id)
    except (KeyError, CheckpointCorrupt):
        files = None
    return checkpoint_json(record, files)


# `variant` of a download: UNSPECIFIED (or none) is the default, MERGED, as in the proto.
_VARIANTS = {
    None: "MERGED",
    "": "MERGED",
    "CHECKPOINT_VARIANT_UNSPECIFIED": "MERGED",
    "CHECKPOINT_VARIANT_MERGED": "MERGED",
    "CHECKPOINT_VARIANT_ADAPTER": "ADAPTER",
}


def _corrupt(exc: CheckpointCorrupt) -> ApiError:
    """A checkpoint whose files no longer match its manifest: refused, never served."""
    return ApiError(
        409,
        f"checkpoint_id: {exc}; it cannot be downloaded",
        param="checkpoint_id",
        code="checkpoint_corrupt",
    )


@router.get("/rl/checkpoints/{checkpoint_id}/download")
async def download_checkpoint(
    request: Request, checkpoint_id: str, variant: Annotated[str | None, Query()] = None
) -> dict[str, Any]:
    """Signed URLs of the variant's files, each with its manifest `size` and `sha256`. Every
    file the manifest lists must be present with its size (else 409, never an omission); each
    is checked against its sha256 again when it is fetched."""
    worker = worker_of(request)
    short = _VARIANTS.get(variant)
    if short is None:
        raise bad_request(
            "variant: must be CHECKPOINT_VARIANT_MERGED or CHECKPOINT_VARIANT_ADAPTER "
            f"(CHECKPOINT_VARIANT_UNSPECIFIED means MERGED); got {variant!r}",
            "variant",
        )
    record = worker.checkpoint(checkpoint_id, principal_of(request), "checkpoint_id")
    if record.type != INFERENCE:
        raise failed_precondition(
            f"checkpoint_id: {checkpoint_id} is a training checkpoint; only inference "
            "checkpoints can be downloaded (create one with the inference-checkpoint operation; "
            "a training checkpoint resumes a session through resume_from_checkpoint_id)",
            "checkpoint_id",
        )
    try:
        files = await run_in_threadpool(worker.checkpoints.variant_files, checkpoint_id, short)
    except CheckpointCorrupt as exc:
        raise _corrupt(exc) from None
    except KeyError:
        if short == "MERGED" and stored_export(worker.checkpoints, checkpoint_id):
            raise bad_request(
                f"variant: checkpoint {checkpoint_id} is an adapter export (the Tinker face's "
                "save_weights_external): it has CHECKPOINT_VARIANT_ADAPTER only",
                "variant",
            ) from None
        if short == "ADAPTER" and record.lora_rank is None:
            raise bad_request(
                f"variant: checkpoint {checkpoint_id} is a full-weight checkpoint; "
                "CHECKPOINT_VARIANT_ADAPTER exists for LoRA checkpoints only "
                "(use CHECKPOINT_VARIANT_MERGED)",
                "variant",
            ) from None
        raise _corrupt(
            CheckpointCorrupt(f"checkpoint {checkpoint_id}: its manifest lists no {short} files")
        ) from None
    who = principal_of(request)
    data = []
    for entry in files:
        if "/" in entry.name:
            raise ApiError(400, f"checkpoint file {entry.name!r} is nested", code="unsupported")
        url_path = FILE_PATH.format(checkpoint_id=checkpoint_id, variant=short, filename=entry.name)
        data.append(
            {
                "filename": entry.name,
                "size": entry.size,
                "sha256": entry.sha256,
                "url": sign_for(request, "GET", url_path, who),
            }
        )
    return {"data": data}


@files_router.get(FILE_PATH)
async def checkpoint_file(
    request: Request, checkpoint_id: str, variant: str, filename: str
) -> FileResponse:
    """Served without a token: the signature in the query string is the credential. The file
    is checked against its manifest sha256 before the first byte goes out (a match is
    remembered while the file is unchanged, so repeated downloads do not re-hash)."""
    issued_to = verify_signed(request, "GET")
    worker = worker_of(request)
    store = worker.checkpoints
    shown = f"{checkpoint_id}/{variant}/{filename}"
    missing = not_found("checkpoint file", shown, "filename")
    # the user it was issued to still owns the checkpoint, or it is still shared (published
    # on the Tinker face); else: missing, the same 404
    owned(
        store.get(checkpoint_id),
        issued_to,
        "checkpoint file",
        shown,
        "filename",
        owner=worker.checkpoint_owner,
        shared=worker.checkpoint_shared,
    )
    try:
        files = await run_in_threadpool(store.variant_files, checkpoint_id, variant, check=False)
        entry = next((e for e in files if e.name == filename), None)
        if entry is None:
            raise missing
        await run_in_threadpool(store.verify, checkpoint_id, entry)
    except KeyError:
        raise missing from None
    except CheckpointCorrupt as exc:
        raise _corrupt(exc) from None
    return FileResponse(entry.path, media_type="application/octet-stream", filename=filename)
