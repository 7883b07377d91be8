"""The seven session operations: `POST .../operations/<kind>` and `GET .../<kind>/{id}`.

One route pair per kind, so the OpenAPI schema carries each kind's body (`trainer.api.openapi`).
POST order: session exists (404) -> `Idempotency-Key` present (400) -> body read (413) ->
key seen before? same body: the original operation; other body: 409 -> payload merged
(`payload_id`) -> body validated against the model's limits (400 naming the field) ->
queued on the session (FIFO). The answer waits `op_inline_wait_s` so quick operations come
back already COMPLETED; otherwise the client polls the GET. A checkpoint write that fails on
storage FAILs the operation with a clear code (`trainer.api.checkpoint_errors`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ValidationError

from trainer.api.bodies import body_hash
from trainer.api.checkpoint_errors import save_checkpoint
from trainer.api.errors import ApiError, bad_request, from_pydantic
from trainer.api.openapi import json_body
from trainer.api.requests import (
    CustomForwardBackwardBody,
    EmptyBody,
    ForwardBackwardBody,
    OptimStepBody,
    SampleBody,
    WeightsSyncBody,
    check_custom,
    check_forward_backward,
    check_sample,
)
from trainer.api.state import json_object, worker_of
from trainer.api.store import OperationRow, ResourceRow
from trainer.api.wire import operation_json
from trainer.api.worker import EngineCall, Worker
from trainer.specs import AdamParams, ModelEntry

router = APIRouter()
MAX_KEY_LENGTH = 256


@dataclass(frozen=True)
class OpKind:
    body: type[BaseModel]
    call: Callable[[Any], EngineCall]
    check: Callable[[Any, ModelEntry], None] | None = None


def _forward_backward(b: ForwardBackwardBody) -> EngineCall:
    return lambda s: s.forward_backward(
        b.loss,
        b.samples,
        forward_only=b.forward_only,
        return_loss_fn_outputs=b.return_loss_fn_outputs,
    )


def _custom(b: CustomForwardBackwardBody) -> EngineCall:
    return lambda s: s.custom_forward_backward(b.samples, b.gradients) or {}


def _optim(b: OptimStepBody) -> EngineCall:
    return lambda s: s.optim_step(b.adam_params or AdamParams())


def _sync(b: WeightsSyncBody) -> EngineCall:
    return lambda s: s.weights_sync(b.weight_sync_type)


def _sample(b: SampleBody) -> EngineCall:
    return lambda s: s.sample(
        b.model_inputs,
        num_samples=b.num_samples,
        sampling_params=b.sampling_params,
        prompt_logprobs=b.prompt_logprobs,
        topk_prompt_logprobs=b.topk_prompt_logprobs,
    )


def _training_checkpoint(_: EmptyBody) -> EngineCall:
    return lambda s: save_checkpoint(s.save_training_checkpoint)


def _inference_checkpoint(_: EmptyBody) -> EngineCall:
    return lambda s: save_checkpoint(s.save_inference_checkpoint)


KINDS: dict[str, OpKind] = {
    "forward-backward": OpKind(ForwardBackwardBody, _forward_backward, check_forward_backward),
    "custom-forward-backward": OpKind(CustomForwardBackwardBody, _custom, check_custom),
    "optim-step": OpKind(OptimStepBody, _optim),
    "weights-sync": OpKind(WeightsSyncBody, _sync),
    "sample": OpKind(SampleBody, _sample, check_sample),
    "training-checkpoint": OpKind(EmptyBody, _training_checkpoint),
    "inference-checkpoint": OpKind(EmptyBody, _inference_checkpoint),
}


def _entry(worker: Worker, session_id: str) -> ModelEntry:
    resource = worker.store.get(ResourceRow, worker.session(session_id).resource_id)
    entry = worker.config.model(resource.spec["base_model"]) if resource is not None else None
    if entry is None:
        raise bad_request("the session's base model is no longer served", "session_id")
    return entry


def _prepare(worker: Worker, session_id: str, kind: str, body: dict[str, Any]) -> EngineCall:
    """Merge an uploaded payload, validate, check limits (blocking: runs in a thread)."""
    spec = KINDS[kind]
    payload_id = body.get("payload_id")
    if payload_id is not None:
        if not isinstance(payload_id, str):
            raise bad_request("payload_id: must be a string", "payload_id")
        full = {k: v for k, v in body.items() if k != "payload_id"}
        full.update(worker.payloads.read_json(session_id, payload_id))
        body = full
    try:
        parsed = spec.body.model_validate(body)
    except ValidationError as exc:
        raise from_pydantic(exc) from None
    if spec.check is not None:
        spec.check(parsed, _entry(worker, session_id))
    return spec.call(parsed)


IDEMPOTENCY_HEADER = {
    "name": "Idempotency-Key",
    "in": "header",
    "required": True,
    "description": "unique per request; a retry reuses it and gets the original operation",
    "schema": {"type": "string", "minLength": 1, "maxLength": MAX_KEY_LENGTH},
}


async def create_operation(request: Request, session_id: str, kind: str) -> dict[str, Any]:
    worker = worker_of(request)
    worker.session(session_id)
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
        call = await run_in_threadpool(_prepare, worker, session_id, kind, body)
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
    worker.session(session_id)
    return operation_json(worker.find_operation(session_id, kind, operation_id))


def _routes(kind: str, spec: OpKind) -> None:
    """One POST and one GET per kind, so the OpenAPI schema names each kind's body."""

    async def post(request: Request, session_id: str) -> dict[str, Any]:
        return await create_operation(request, session_id, kind)

    async def poll(request: Request, session_id: str, operation_id: str) -> dict[str, Any]:
        return await get_operation(request, session_id, kind, operation_id)

    name = kind.replace("-", "_")
    base = f"/rl/training-sessions/{{session_id}}/operations/{kind}"
    extra = json_body(spec.body, required=spec.body is not EmptyBody)
    extra["parameters"] = [IDEMPOTENCY_HEADER]
    router.add_api_route(base, post, methods=["POST"], name=f"create_{name}", openapi_extra=extra)
    router.add_api_route(f"{base}/{{operation_id}}", poll, methods=["GET"], name=f"get_{name}")


for _kind_name, _spec in KINDS.items():
    _routes(_kind_name, _spec)
