"""`/v1/accounts`, and the RLOR trainer jobs of an account: create, get, list, delete, resume.

Every route takes the caller's key (`auth.FireworksAuth`); an account in the path that is not
the caller's is the 404 of a missing account, whatever exists there.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import ValidationError

from trainer.api.fireworks.auth import mine, principal_of
from trainer.api.fireworks.bodies import JOB_ID, CreateJobBody
from trainer.api.fireworks.jobs import JOB_FIELD, STATES, JobRecord
from trainer.api.fireworks.service import FireworksFace
from trainer.serving.errors import bad_request, from_pydantic, not_found
from trainer.serving.tenants import Principal

router = APIRouter()
BODY_MAX = 1 << 20
CREATE_QUERY = ("trainingShape", "deploymentId")  # echoed; skipValidations is accepted only


def face_of(request: Request) -> FireworksFace:
    face: FireworksFace = request.app.state.fireworks
    return face


def account_of(request: Request, account: str) -> Principal:
    """The caller, when `account` is its own; the 404 of a missing account otherwise."""
    who = principal_of(request)
    if not mine(who, account):
        raise not_found("account", account, "account")
    return who


def page_args(request: Request, default: int = 50, most: int = 200) -> tuple[int, int]:
    """(pageSize, offset) from `pageSize` and `pageToken` (the previous page's
    `nextPageToken`); a 400 naming the field otherwise."""
    raw = request.query_params.get("pageSize") or str(default)
    if not raw.isdigit() or len(raw) > 9:
        raise bad_request("pageSize: must be a non-negative integer", "pageSize")
    size = min(most, int(raw)) or default
    token = request.query_params.get("pageToken") or "0"
    if not token.isdigit() or len(token) > 12:
        raise bad_request("pageToken: not a token this worker issued", "pageToken")
    return size, int(token)


def page(items: list[Any], size: int, offset: int) -> tuple[list[Any], str]:
    chunk = items[offset : offset + size]
    more = offset + size < len(items)
    return chunk, str(offset + size) if more else ""


def job_id_of(job_id: str) -> str:
    if not JOB_ID.fullmatch(job_id):
        raise bad_request(
            f"{JOB_FIELD}: {job_id[:200]!r} is not a job id (1-63 lowercase letters, digits "
            "or '-', starting with a letter or digit)",
            JOB_FIELD,
        )
    return job_id


async def body_of(request: Request) -> CreateJobBody:
    raw = await request.body()
    if len(raw) > BODY_MAX:
        raise bad_request(f"body: more than {BODY_MAX} bytes", "body")
    try:
        data = json.loads(raw or b"{}")
    except ValueError as exc:
        raise bad_request(
            f"request body is not valid JSON: {exc}", "body", "invalid_json"
        ) from None
    if not isinstance(data, dict):
        raise bad_request("body: must be a JSON object", "body")
    try:
        return CreateJobBody.model_validate(data)
    except ValidationError as exc:
        raise from_pydantic(exc) from None


@router.get("/v1/accounts")
async def list_accounts(request: Request) -> dict[str, Any]:
    """Exactly the caller's account (`pageSize` accepted; one account per key)."""
    page_args(request)
    return {"accounts": [{"name": f"accounts/{principal_of(request).user}"}], "totalSize": 1}


@router.get("/v1/accounts/{account}")
async def get_account(request: Request, account: str) -> dict[str, Any]:
    account_of(request, account)
    return {"name": f"accounts/{account}", "state": "READY"}


@router.post("/v1/accounts/{account}/rlorTrainerJobs")
async def create_job(request: Request, account: str) -> dict[str, Any]:
    who = account_of(request, account)
    body = await body_of(request)
    job_id = request.query_params.get("rlorTrainerJobId")
    if job_id is not None:
        job_id_of(job_id)
    skip = request.query_params.get("skipValidations")
    if skip is not None and skip.lower() not in ("true", "false", "1", "0"):
        raise bad_request("skipValidations: must be true or false", "skipValidations")
    query = {name: request.query_params.get(name, "") for name in CREATE_QUERY}
    face = face_of(request)
    job = await run_in_threadpool(face.jobs.create, who, job_id, body, query)
    return face.jobs.to_json(job)


@router.get("/v1/accounts/{account}/rlorTrainerJobs")
async def list_jobs(request: Request, account: str) -> dict[str, Any]:
    """`filter`: `state=<JOB_STATE_...>` or `state!=...` (quotes allowed); `orderBy`:
    `createTime` (default) or `createTime desc`."""
    who = account_of(request, account)
    size, offset = page_args(request)
    face = face_of(request)
    wanted = _state_filter(request.query_params.get("filter") or "")
    order = (request.query_params.get("orderBy") or "createTime").strip()
    if order not in ("createTime", "createTime asc", "createTime desc", "create_time desc"):
        raise bad_request("orderBy: must be createTime or 'createTime desc'", "orderBy")
    tail = "ORDER BY created_at DESC, id DESC" if "desc" in order else "ORDER BY created_at, id"

    def read() -> list[dict[str, Any]]:
        rows = face.records.select(JobRecord, "account = ?", (who.user,), tail)
        views = [face.jobs.view(r) for r in rows]
        keep = [v for v in views if wanted is None or (v.state == wanted[1]) == wanted[0]]
        return [face.jobs.to_json(v) for v in keep]

    jobs = await run_in_threadpool(read)
    chunk, token = page(jobs, size, offset)
    return {"rlorTrainerJobs": chunk, "nextPageToken": token, "totalSize": len(jobs)}


def _state_filter(text: str) -> tuple[bool, str] | None:
    """(equal, state) of a `filter`; a 400 naming `filter` for any other expression."""
    if not text.strip():
        return None
    for op, equal in (("!=", False), ("=", True)):
        left, sep, right = text.partition(op)
        if sep and left.strip() == "state":
            state = right.strip().strip('"')
            if state in STATES:
                return equal, state
    raise bad_request(
        f"filter: {text[:200]!r} is not supported (state=<JOB_STATE_...> or state!=...)",
        "filter",
    )


@router.get("/v1/accounts/{account}/rlorTrainerJobs/{job_id}")
async def get_job(request: Request, account: str, job_id: str) -> dict[str, Any]:
    who = account_of(request, account)
    face = face_of(request)
    job = await run_in_threadpool(face.jobs.find, who, job_id_of(job_id))
    return face.jobs.to_json(job)


@router.delete("/v1/accounts/{account}/rlorTrainerJobs/{job_id}")
async def delete_job(request: Request, account: str, job_id: str) -> dict[str, Any]:
    who = account_of(request, account)
    face = face_of(request)

    def run() -> JobRecord:
        return face.jobs.delete(face.jobs.find(who, job_id_of(job_id)))

    return face.jobs.to_json(await run_in_threadpool(run))


@router.post("/v1/accounts/{account}/rlorTrainerJobs/{job_id}:resume")
async def resume_job(request: Request, account: str, job_id: str) -> dict[str, Any]:
    who = account_of(request, account)
    face = face_of(request)

    def run() -> JobRecord:
        return face.jobs.resume(who, face.jobs.find(who, job_id_of(job_id)))

    return face.jobs.to_json(await run_in_threadpool(run))
