"""A job's checkpoints and their promotion; models; training shapes."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import ValidationError

from trainer.api.fireworks.auth import PUBLIC_ACCOUNT, mine, principal_of
from trainer.api.fireworks.bodies import PromoteBody
from trainer.api.fireworks.routes_jobs import (
    BODY_MAX,
    account_of,
    face_of,
    job_id_of,
    page,
    page_args,
)
from trainer.serving.errors import bad_request, from_pydantic, not_found

router = APIRouter()


@router.get("/v1/accounts/{account}/rlorTrainerJobs/{job_id}/checkpoints")
async def list_checkpoints(request: Request, account: str, job_id: str) -> dict[str, Any]:
    """Oldest first (as the SDK documents); `pageSize` (at most 200) and `pageToken`."""
    who = account_of(request, account)
    size, offset = page_args(request, default=200)
    face = face_of(request)

    def read() -> list[dict[str, Any]]:
        job = face.jobs.find(who, job_id_of(job_id))
        return [face.catalog.checkpoint_json(job, c) for c in face.catalog.checkpoints(job)]

    rows = await run_in_threadpool(read)
    chunk, token = page(rows, size, offset)
    return {"checkpoints": chunk, "nextPageToken": token, "totalSize": len(rows)}


@router.post("/v1/accounts/{account}/checkpoints/{checkpoint}:promote")
async def promote(request: Request, account: str, checkpoint: str) -> dict[str, Any]:
    """Answers at once with the model (`async_promotion` accepted, never an operation)."""
    who = account_of(request, account)
    raw = await request.body()
    if len(raw) > BODY_MAX:
        raise bad_request(f"body: more than {BODY_MAX} bytes", "body")
    try:
        data = json.loads(raw or b"{}")
        body = PromoteBody.model_validate(data)
    except ValidationError as exc:
        raise from_pydantic(exc) from None
    except ValueError as exc:
        raise bad_request(
            f"request body is not valid JSON: {exc}", "body", "invalid_json"
        ) from None
    face = face_of(request)

    def run() -> dict[str, Any]:
        model = face.catalog.promote(who, checkpoint, body)
        entry = face.catalog.catalogue_model(model.base_model)
        assert entry is not None  # a checkpoint's base model is the catalogue's
        name = f"accounts/{model.account}/models/{model.id}"
        return face.catalog.model_json(name, entry, model)

    return {"model": await run_in_threadpool(run)}


@router.get("/v1/accounts/{account}/models/{model}")
async def get_model(request: Request, account: str, model: str) -> dict[str, Any]:
    """A catalogue model (any key reads it), or a model promoted in the caller's account."""
    who = principal_of(request)
    name = f"accounts/{account}/models/{model}"
    face = face_of(request)
    entry = face.catalog.catalogue_model(name)
    if entry is not None:
        return face.catalog.model_json(name, entry, None)
    promoted = face.records.model(account, model) if mine(who, account) else None
    base = face.catalog.catalogue_model(promoted.base_model) if promoted is not None else None
    if promoted is None or base is None:
        raise not_found("model", model, "name")
    return face.catalog.model_json(name, base, promoted)


def _shape_account(request: Request, account: str) -> None:
    if account != PUBLIC_ACCOUNT and not mine(principal_of(request), account):
        raise not_found("account", account, "account")


@router.get("/v1/accounts/{account}/trainingShapes/{shape}/versions")
async def list_shape_versions(request: Request, account: str, shape: str) -> dict[str, Any]:
    """One version per shape (`filter=latest_validated=true` or none)."""
    _shape_account(request, account)
    page_args(request)
    wanted = (request.query_params.get("filter") or "").replace(" ", "")
    if wanted not in ("", "latest_validated=true", "validated=true"):
        raise bad_request(f"filter: {wanted[:200]!r} is not supported", "filter")
    version = face_of(request).catalog.shape_version(account, shape)
    if version is None:
        raise not_found("training shape", f"accounts/{account}/trainingShapes/{shape}", "name")
    return {"trainingShapeVersions": [version], "nextPageToken": "", "totalSize": 1}


@router.get("/v1/accounts/{account}/trainingShapes/{shape}/versions/{version}")
async def get_shape_version(
    request: Request, account: str, shape: str, version: str
) -> dict[str, Any]:
    _shape_account(request, account)
    found = face_of(request).catalog.shape_version(account, shape)
    if found is None or not found["name"].endswith(f"/versions/{version}"):
        name = f"accounts/{account}/trainingShapes/{shape}/versions/{version}"
        raise not_found("training shape version", name, "name")
    return found
