"""The deployments of an account: create, get, list, patch, delete (the SDK's
`DeploymentManager`; docs/semantics.md §24).

Every route takes the caller's key (`auth.FireworksAuth`); an account in the path that is not
the caller's answers as a missing deployment would.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool

from trainer.api.fireworks.auth import mine, principal_of
from trainer.api.fireworks.deployments import ID_FIELD, DeploymentRecord, check_id, missing
from trainer.api.fireworks.routes_jobs import BODY_MAX, account_of, face_of, page, page_args
from trainer.serving.errors import bad_request
from trainer.serving.tenants import Principal

router = APIRouter()
PREFIX = "/v1/accounts/{account}/deployments"
FLAGS = ("skipShapeValidation", "acceptShapelessRisk", "disableSpeculativeDecoding")
DELETE_FLAGS = ("ignoreChecks", "hard")

__all__ = ["face_of", "json_body", "router"]


def caller(request: Request, account: str, deployment_id: str | None = None) -> Principal:
    """The caller, when `account` is its own; otherwise the 404 of a missing deployment (of
    a missing account for the routes that name none)."""
    if deployment_id is None:
        return account_of(request, account)
    who = principal_of(request)
    if not mine(who, account):
        raise missing(deployment_id)
    return who


def flags(request: Request, names: tuple[str, ...]) -> None:
    """Boolean query flags: accepted (they change nothing here), a 400 naming a bad one."""
    for name in names:
        value = request.query_params.get(name)
        if value is not None and value.lower() not in ("true", "false", "1", "0", ""):
            raise bad_request(f"{name}: must be true or false", name)


async def json_body(request: Request) -> Any:
    raw = await request.body()
    if len(raw) > BODY_MAX:
        raise bad_request(f"body: more than {BODY_MAX} bytes", "body")
    try:
        return json.loads(raw or b"{}")
    except ValueError as exc:
        raise bad_request(
            f"request body is not valid JSON: {exc}", "body", "invalid_json"
        ) from None


@router.post(PREFIX)
async def create_deployment(request: Request, account: str) -> dict[str, Any]:
    who = caller(request, account)
    deployment_id = request.query_params.get(ID_FIELD)
    if not deployment_id:
        raise bad_request(f"{ID_FIELD}: the query parameter is required", ID_FIELD)
    check_id(deployment_id)
    flags(request, FLAGS)
    data = await json_body(request)
    face = face_of(request)
    record = await run_in_threadpool(face.deployments.create, who, deployment_id, data)
    return face.deployments.to_json(record)


@router.get(PREFIX)
async def list_deployments(request: Request, account: str) -> dict[str, Any]:
    who = caller(request, account)
    size, offset = page_args(request)
    face = face_of(request)

    def read() -> list[dict[str, Any]]:
        rows = face.records.select(
            DeploymentRecord, "account = ?", (who.user,), "ORDER BY created_at, id"
        )
        return [face.deployments.to_json(r) for r in rows]

    items = await run_in_threadpool(read)
    chunk, token = page(items, size, offset)
    return {"deployments": chunk, "nextPageToken": token, "totalSize": len(items)}


@router.get(PREFIX + "/{deployment_id}")
async def get_deployment(request: Request, account: str, deployment_id: str) -> dict[str, Any]:
    who = caller(request, account, deployment_id)
    face = face_of(request)
    record = await run_in_threadpool(face.deployments.find, who, check_id(deployment_id))
    return face.deployments.to_json(record)


@router.patch(PREFIX + "/{deployment_id}")
async def patch_deployment(request: Request, account: str, deployment_id: str) -> dict[str, Any]:
    who = caller(request, account, deployment_id)
    check_id(deployment_id)
    data = await json_body(request)
    mask = request.query_params.get("updateMask")
    face = face_of(request)
    record = await run_in_threadpool(face.deployments.update, who, deployment_id, data, mask)
    return face.deployments.to_json(record)


@router.delete(PREFIX + "/{deployment_id}")
async def delete_deployment(request: Request, account: str, deployment_id: str) -> dict[str, Any]:
    who = caller(request, account, deployment_id)
    check_id(deployment_id)
    flags(request, DELETE_FLAGS)
    face = face_of(request)
    record = await run_in_threadpool(face.deployments.delete, who, deployment_id)
    return face.deployments.to_json(record)
