"""Small request helpers shared by the routers: the worker, URLs, list query parameters and
the pages of a listing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import Request

from trainer.api.auth import NOBODY, listed_owner, principal_of
from trainer.api.signing import refused_param
from trainer.contract.values import parse_int_text
from trainer.serving.bodies import read_json
from trainer.serving.catalogue import ResourceRow, SessionRow
from trainer.serving.errors import ApiError, bad_request
from trainer.serving.jsonparse import Bounds
from trainer.serving.ownership import usable_cursor
from trainer.serving.tenants import Principal
from trainer.serving.worker import Worker

# a checkpoint file behind a signed URL (served by the RL face, linked from both faces)
FILE_PATH = "/v1/rl/files/checkpoints/{checkpoint_id}/{variant}/{filename}"
WILDCARD_HOSTS = ("", "0.0.0.0", "::")
Listed = TypeVar("Listed", ResourceRow, SessionRow)


def worker_of(request: Request) -> Worker:
    worker: Worker = request.app.state.worker
    return worker


def base_url(request: Request) -> str:
    """Where signed URLs point: `public_url` if configured, else the address the worker is
    bound to (`http://<host>:<port>` of `trainer serve`), never the request's `Host` header,
    which any client can forge. A wildcard host (`0.0.0.0`, `::`) or port 0 takes the local
    address of the connection's socket instead."""
    config = worker_of(request).config
    if config.public_url:
        return config.public_url.rstrip("/")
    host, port = config.host, config.port
    local = request.scope.get("server") or (host, port)
    if host in WILDCARD_HOSTS:
        host = str(local[0])
    if port == 0 and local[1] is not None:
        port = int(local[1])
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def verify_signed(request: Request, method: str) -> Principal | None:
    """Refuse (403) a signed-URL request whose signature is missing, wrong or expired. The
    user the URL was issued to (None: a URL from before users were signed in), for the route's
    ownership check; the audit trail records it as the request's user."""
    query = request.query_params
    user = query.get("user")
    reason = request.app.state.signer.verify(
        method, request.url.path, query.get("expires"), query.get("sig"), user=user
    )
    if reason is not None:
        param = refused_param(reason)
        raise ApiError(
            403, f"{param}: signed URL refused: {reason}", param=param, code="invalid_signature"
        )
    if user is None:
        return None
    request.state.signed_user = user
    return worker_of(request).principals(user) or Principal(user)


def sign_for(request: Request, method: str, path: str, who: Principal) -> str:
    """A signed URL of `path` pointing at this worker, issued to `who`."""
    signer = request.app.state.signer
    url: str = signer.sign(base_url(request), method, path, user=who.user)
    return url


def parse_limit(raw: str | None, default: int = 20) -> int:
    """`limit` of a list route: ASCII digits in [1, 100] (no Unicode digits, no 5,000-digit
    numbers: those are a 400 naming `limit`, not a crash in `int()`)."""
    if raw is None or raw == "":
        return default
    value = parse_int_text(raw)
    if value is None or not 1 <= value <= 100:
        shown = raw if len(raw) <= 40 else f"{raw[:40]}... ({len(raw)} characters)"
        raise bad_request(f"limit: must be an integer in [1, 100], got {shown!r}", "limit")
    return value


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


def listed_rows(
    request: Request,
    kind: type[Listed],
    allowed: tuple[str, ...],
    after: str | None,
    created_by: str | None,
    limit: str | None,
    where: dict[str, str] | None = None,
    shared: Callable[[Listed], bool] = lambda _: False,
) -> tuple[list[Listed], bool, int]:
    """One page of a listing of `kind` rows: the rows, whether more exist, and the page size
    (`limit`). Filtered by `status` (one of `allowed`), `where` and the owner the caller may
    list (`listed_owner`); a `created_by` the caller may not list, or an `after` cursor that
    is not the caller's (nor `shared`), gives an empty page, as for a missing one."""
    worker = worker_of(request)
    size = parse_limit(limit)
    statuses = parse_statuses(request, allowed)
    who = principal_of(request)
    owner = listed_owner(who, created_by)
    if owner is NOBODY:
        return [], False, size
    if after and not usable_cursor(worker.store.get(kind, after), who, shared=shared):
        return [], False, size  # a cursor not the caller's reads as a missing one
    if owner is not None:
        where = {**(where or {}), "owner": owner}
    rows, more = worker.store.page(
        kind, after=after or None, limit=size, where=where, statuses=statuses
    )
    return rows, more, size


async def json_object(
    request: Request, limit: int, *, arrays: bool = False, decoder: str | None = None
) -> dict[str, Any]:
    """The body's JSON object (`{}` if empty), 413 past `limit`, parsed off the event loop: in
    a thread when small, in the body parser's child process when large (`trainer.serving.bodies`),
    within the configured models' bounds (a 400 naming the field at the first one crossed).
    `arrays`: an operation body, whose bulk numeric lists come back as numpy arrays.
    `decoder`: not JSON; `module:function` decodes the bytes (`trainer.serving.bodychild`)."""
    worker = worker_of(request)
    parser = worker.payloads.parser
    parser.bounds = body_bounds(worker)
    return await read_json(request, limit, parser, pack=arrays, decoder=decoder)


def body_bounds(worker: Worker) -> Bounds:
    """What one request body may hold: the largest of the configured models' limits."""
    return Bounds.of_models(worker.config.models)
