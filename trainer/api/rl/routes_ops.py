"""The session operations: `POST .../operations/<kind>` and `GET .../<kind>/{id}`.

One route pair per entry of the operation table (`trainer.serving.operations`), so the OpenAPI
schema carries each kind's body (`trainer.api.openapi`).
POST order: session exists (404) -> `Idempotency-Key` present (400) -> body read (413) ->
key seen before? same body: the original operation; other body: 409 -> payload merged
(`payload_id`) -> body validated against the model's limits (400 naming the field) ->
queued on the session (FIFO). The answer waits `op_inline_wait_s` so quick operations come
back already COMPLETED; otherwise the client polls the GET. A checkpoint write that fails on
storage FAILs the operation with a clear code (`trainer.serving.checkpoint_errors`).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool

from trainer.api.auth import principal_of
from trainer.api.http import json_object, worker_of
from trainer.api.openapi import json_body
from trainer.serving.bodies import body_hash
from trainer.serving.catalogue import OperationRow
from trainer.serving.errors import ApiError, bad_request
from trainer.serving.operations import OPERATIONS, Operation, prepare_call
from trainer.serving.requests import EmptyBody
from trainer.serving.responses import operation_json
from trainer.serving.worker import Worker

router = APIRouter()
MAX_KEY_LENGTH = 256


IDEMPOTENCY_HEADER = {
    "name": "Idempotency-Key",
    "in": "header",
    "required": True,
    "description": "unique per request; a retry reuses it and gets the original operation",
    "schema": {"type": "string", "minLength": 1, "maxLength": MAX_KEY_LENGTH},
}


async def create_operation(request: Request, session_id: str, spec: Operation) -> dict[str, Any]:
    kind = spec.kind
    worker = worker_of(request)
    worker.session(session_id, principal_of(request))
    key = request.headers.get("idempotency-key", "").strip()
    if not key:
        raise bad_request(
            "Idempotency-Key: header required on operation requests (any unique string, e.g. a "
            "UUID; retries reuse it)",
            "Idempotency-Key",
            "missing_idempotency_key",
        )
    if len(key) > MAX_KEY_LENGTH:
        raise bad_request(
            f"Idempotency-Key: at most {MAX_KEY_LENGTH} characters", "Idempotency-Key"
        )
    # parsed off the event loop (a large body in the parser's child), bulk arrays packed
    body = await json_object(request, worker.config.max_body_bytes, arrays=True)
    digest = await run_in_threadpool(body_hash, kind, body)
    existing = worker.op_by_key(session_id, key)
    if existing is None:
        call = await run_in_threadpool(prepare_call, worker, session_id, spec, body)
        existing = worker.op_by_key(session_id, key)  # a concurrent retry may have won
    if existing is not None:
        if existing.body_hash != digest:
            raise ApiError(
                409,
                f"Idempotency-Key {key!r} was used for a different request on this session; "
                "use a new key for a new request",
                param="Idempotency-Key",
                code="idempotency_key_reused",
            )
        return operation_json(existing)
    row = worker.submit(session_id, kind, key, digest, call)
    return operation_json(await _wait_briefly(worker, row))


async def _wait_briefly(worker: Worker, row: OperationRow) -> OperationRow:
    future = worker.oplog.futures.get(row.id)
    if future is not None and worker.config.op_inline_wait_s > 0:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(
                asyncio.shield(asyncio.wrap_future(future)), worker.config.op_inline_wait_s
            )
    return worker.find_operation(row.session_id, row.kind, row.id)


async def get_operation(
    request: Request, session_id: str, kind: str, operation_id: str
) -> dict[str, Any]:
    worker = worker_of(request)
    worker.session(session_id, principal_of(request))
    return operation_json(worker.find_operation(session_id, kind, operation_id))


def add_routes(router: APIRouter, spec: Operation) -> None:
    """One POST and one GET per table entry, so the OpenAPI schema names each kind's body."""
    kind = spec.kind

    async def post(request: Request, session_id: str) -> dict[str, Any]:
        return await create_operation(request, session_id, spec)

    async def poll(request: Request, session_id: str, operation_id: str) -> dict[str, Any]:
        return await get_operation(request, session_id, kind, operation_id)

    name = kind.replace("-", "_")
    base = f"/rl/training-sessions/{{session_id}}/operations/{kind}"
    extra = json_body(spec.body, required=spec.body is not EmptyBody)
    extra["parameters"] = [IDEMPOTENCY_HEADER]
    router.add_api_route(base, post, methods=["POST"], name=f"create_{name}", openapi_extra=extra)
    router.add_api_route(f"{base}/{{operation_id}}", poll, methods=["GET"], name=f"get_{name}")


for _spec in OPERATIONS.values():
    if _spec.rl_face:
        add_routes(router, _spec)
