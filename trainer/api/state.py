"""Small request helpers shared by the routers: the worker, URLs, list query parameters."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request

from trainer.api.errors import ApiError, bad_request
from trainer.api.worker import Worker


def worker_of(request: Request) -> Worker:
    worker: Worker = request.app.state.worker
    return worker


def base_url(request: Request) -> str:
    """Where signed URLs point: `public_url` if configured, else the URL the client used."""
    public: str | None = worker_of(request).config.public_url
    return public.rstrip("/") if public else str(request.base_url).rstrip("/")


def verify_signed(request: Request, method: str) -> None:
    """Refuse (403) a signed-URL request whose signature is missing, wrong or expired."""
    query = request.query_params
    reason = request.app.state.signer.verify(
        method, request.url.path, query.get("expires"), query.get("sig")
    )
    if reason is not None:
        raise ApiError(403, f"signed URL refused: {reason}", param="sig", code="invalid_signature")


def parse_limit(raw: str | None, default: int = 20) -> int:
    if raw is None or raw == "":
        return default
    if not raw.strip().isdigit() or not 1 <= int(raw) <= 100:
        raise bad_request(f"limit: must be an integer in [1, 100], got {raw!r}", "limit")
    return int(raw)


def parse_statuses(request: Request, allowed: tuple[str, ...]) -> list[str] | None:
    """`status` filters as the SDK sends them (comma-joined) or as `status[]`, repeated."""
    values: list[str] = []
    for key in ("status", "status[]"):
        for raw in request.query_params.getlist(key):
            values.extend(v.strip() for v in raw.split(",") if v.strip())
    for value in values:
        if value not in allowed:
            raise bad_request(f"status: unknown status {value!r}; one of {list(allowed)}", "status")
    return values or None


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise ApiError(
            413,
            f"request body of {declared} bytes exceeds {limit}; large bodies go through "
            "payloads/upload-url (the SDK does this above 0.5 MiB)",
            param="body",
            code="request_too_large",
        )
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(
                413, f"request body exceeds {limit} bytes", param="body", code="request_too_large"
            )
        chunks.append(chunk)
    return b"".join(chunks)


async def json_object(request: Request, limit: int) -> dict[str, Any]:
    raw = await read_body(request, limit)
    if not raw.strip():
        return {}
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(
            f"request body is not valid JSON: {exc}", "body", "invalid_json"
        ) from None
    if not isinstance(value, dict):
        raise bad_request("request body must be a JSON object", "body", "invalid_json")
    return value
