"""The audit trail: one line in `<storage>/audit.jsonl` per mutating call, on both faces, and
`GET /v1/rl/audit` for an admin to read it.

What is audited (`audited`, decided per route, the same for every request of it):
- every POST, PUT, PATCH and DELETE route, except the pure reads below: creates, stops,
  patches, each operation, checkpoint saves, loads and deletes, payload uploads and the issuing
  of signed upload or download URLs;
- the GET routes that hand out a checkpoint's or a payload's bytes or signed URLs to them
  (`DOWNLOADS`).
Not audited: the reads that the Tinker SDK sends as POSTs (`TINKER_READS`: futures, heartbeats,
telemetry, info, client config), `POST /v1/rl/model-resources/estimate-cost` (computes, changes
nothing), every other GET, and the Tinker face's catch-all for routes it does not serve.

A line holds `seq`, `time` (Unix seconds), `user` (the key's user; for a signed-URL upload or
download, which carries no key, the user the URL was issued to; null for a request refused
before its key or a valid signature was known), `method`,
`route` (the route template, e.g. `/v1/rl/training-sessions/{session_id}/stop`), `ids` (the
path parameters), `created` (the id a create answered with, when its answer is a small JSON
object naming one), `status` (the HTTP status) and `request_id` (the client's `X-Request-Id`,
when it is a plain token). Never a body, a header, a key or a query string (which holds the
signature of a signed URL).

The trail is read by an admin: `GET /v1/rl/audit?limit=100&before=<seq>&user=<user>`, newest
first; `next_before` is the cursor of the next (older) page, null on the last one. Any other
caller, a missing or non-admin key included, gets the 404 of a route that does not exist, so
the route does not reveal itself.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from trainer.api.auth import principal_of
from trainer.api.keys import USER_PATTERN, KeyRing, Principal
from trainer.serving.audit_log import AuditLog
from trainer.serving.errors import bad_request

MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
TINKER_READS = frozenset(
    f"/api/v1/{name}"
    for name in (
        "client/config",
        "client/dynamic_config",
        "telemetry",
        "session_heartbeat",
        "get_info",
        "weights_info",
        "retrieve_future",
        "retrieve_futures",
    )
)
READS = TINKER_READS | {"/v1/rl/model-resources/estimate-cost"}
DOWNLOADS = frozenset(
    {
        "/v1/rl/checkpoints/{checkpoint_id}/download",
        "/v1/rl/files/checkpoints/{checkpoint_id}/{variant}/{filename}",
        "/v1/rl/payloads/{session_id}/{payload_id}",
        "/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/external_weights_urls",
    }
)
# the Tinker face's catch-all, and the 404 of other methods on the audit route itself
NOT_SERVED = ("/api/v1", "/api/v1/", "/api/v1/{route:path}", "/v1/rl/audit")
CREATED_KEYS = ("id", "request_id", "session_id", "sampling_session_id", "model_id")
CREATED_MAX_BYTES = 64 * 1024  # a larger answer is not read for its id
_REQUEST_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")


def audited(method: str, path: str) -> bool:
    """Whether a call of this route template is a line of the audit trail."""
    if path in NOT_SERVED:
        return False
    if method in MUTATING:
        return path not in READS
    return method == "GET" and path in DOWNLOADS


def mounted_routes(routes: list[Any], prefix: str = "") -> Iterator[tuple[Any, str]]:
    """(route, full path template) of every route, through included routers (FastAPI >=
    0.165 keeps an included router as one entry, its prefix in `include_context`)."""
    for route in routes:
        included = getattr(route, "original_router", None)
        if included is not None:
            yield from mounted_routes(included.routes, prefix + route.include_context.prefix)
        elif hasattr(route, "path"):
            yield route, prefix + route.path


class AuditMiddleware:
    """Write a line per audited call once its answer is sent (pure ASGI, innermost user
    middleware, so the router's `scope["route"]` and the auth's principal are seen).

    The route template comes from the route the router picked, looked up in the app's route
    table (an included router's route knows only its own path, not the prefix)."""

    def __init__(self, app: ASGIApp, log: AuditLog, fastapi_app: Any) -> None:
        self.app = app
        self.log = log
        self.fastapi_app = fastapi_app
        self._templates: dict[int, str] | None = None

    def template(self, route: Any) -> str | None:
        if self._templates is None:  # every route is mounted by the first request
            self._templates = {
                id(r): path for r, path in mounted_routes(self.fastapi_app.router.routes)
            }
        return self._templates.get(id(route))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope.setdefault("state", {})  # shared with `request.state`: the principal lands here
        status = 500  # an exception past the handlers answers 500
        answer: list[bytes] = []
        answer_size = 0
        json_answer = False

        async def watch(message: Message) -> None:
            nonlocal status, answer_size, json_answer
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers = dict(message.get("headers") or [])
                json_answer = headers.get(b"content-type", b"").startswith(b"application/json")
            elif message["type"] == "http.response.body" and json_answer:
                body = message.get("body", b"")
                answer_size += len(body)
                if answer_size <= CREATED_MAX_BYTES:
                    answer.append(body)
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            route = scope.get("route")
            path = self.template(route) if route is not None else None
            if path is not None and audited(scope["method"], path):
                body = b"".join(answer) if answer_size <= CREATED_MAX_BYTES else b""
                self.log.append(_entry(scope, path, status, body))


def _entry(scope: Scope, path: str, status: int, answer: bytes) -> dict[str, Any]:
    principal = scope.get("state", {}).get("principal")
    ids = {k: str(v) for k, v in (scope.get("path_params") or {}).items()}
    headers = dict(scope.get("headers") or [])
    request_id = headers.get(b"x-request-id", b"").decode("latin-1")
    return {
        "user": principal.user if isinstance(principal, Principal) else _signed_user(scope),
        "method": scope["method"],
        "route": path,
        "ids": ids,
        "created": _created(answer, set(ids.values())) if 200 <= status < 300 else None,
        "status": status,
        "request_id": request_id if _REQUEST_ID.fullmatch(request_id) else None,
    }


def _signed_user(scope: Scope) -> str | None:
    """The user a signed URL was issued to (`http.verify_signed`), for a call without a key."""
    user = scope.get("state", {}).get("signed_user")
    return user if isinstance(user, str) else None


def _created(answer: bytes, known: set[str]) -> str | None:
    """The id a create answered with (not one of the path's)."""
    if not answer:
        return None
    try:
        value = json.loads(answer)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    for key in CREATED_KEYS:
        found = value.get(key)
        if isinstance(found, str) and found not in known and _REQUEST_ID.fullmatch(found):
            return found
    return None


# -- reading it ----------------------------------------------------------------------------

router = APIRouter()
NOT_FOUND = StarletteHTTPException(404, "Not Found")  # what a route that does not exist says


def admin_of(request: Request) -> Principal:
    """The admin a request's bearer key names; anyone else gets the 404 of a missing route."""
    keys: KeyRing = request.app.state.keys
    if keys.open:
        return principal_of(request)  # --no-auth: the loopback user is `local`, an admin
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    principal = keys.identify(given.strip()) if scheme.lower() == "bearer" and given else None
    if principal is None or not principal.admin:
        raise NOT_FOUND
    request.state.principal = principal
    return principal


def _int_query(request: Request, name: str, default: int | None, low: int, high: int) -> int | None:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not raw.isdigit() or len(raw) > 18 or not low <= int(raw) <= high:
        raise bad_request(f"{name}: must be an integer from {low} to {high}", name)
    return int(raw)


@router.get("/v1/rl/audit", include_in_schema=False)
async def read_audit(request: Request) -> dict[str, Any]:
    """Newest first. Query: `limit` (1-1000, default 100), `before` (a `seq`: the page holds
    older lines only; the previous page's `next_before`), `user` (only that user's lines).
    The admin check comes first, so a bad query from anyone else is the same 404."""
    admin_of(request)
    limit = _int_query(request, "limit", 100, 1, 1000)
    before = _int_query(request, "before", None, 1, 1 << 62)
    user = request.query_params.get("user")
    if user is not None and not USER_PATTERN.fullmatch(user):
        raise bad_request("user: not a user id (1-64 letters, digits, '_', '.', '@', '-')", "user")
    log: AuditLog = request.app.state.audit
    entries, more, damaged = await run_in_threadpool(log.page_report, limit or 100, before, user)
    return {
        "data": entries,
        "has_more": more,
        "next_before": entries[-1]["seq"] if more else None,
        "damaged_lines": damaged,  # lines skipped on the way (cut short by a crash)
    }


@router.api_route(
    "/v1/rl/audit", methods=["POST", "PUT", "PATCH", "DELETE"], include_in_schema=False
)
async def audit_other_methods() -> None:
    raise NOT_FOUND  # not a 405, which would say that the route exists
