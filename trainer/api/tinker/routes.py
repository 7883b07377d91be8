"""The Tinker REST API's service routes: health, capabilities, client config, sessions and
heartbeats, models (`create_model`, `get_info`, `weights_info`), and the futures protocol
(`retrieve_future`). Training, sampling and checkpoint routes are in the sibling modules.

Every `/api/v1/...` route needs the worker's token as `X-API-Key` (the SDK's header) or as a
bearer token (`trainer.api.tinker.face.TinkerAuth`). Requests that run on the engine answer a
future at once (`{"request_id": ...}`); the SDK polls `retrieve_future`, which waits up to
`LONG_POLL_S` for the result and otherwise answers `try_again`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from trainer.api.auth import principal_of
from trainer.api.http import json_object
from trainer.api.tinker import convert, models, names, paths, proto
from trainer.api.tinker.binding import Binding, binding_of
from trainer.api.tinker.bridge import TinkerBridge
from trainer.api.tinker.identity import RequestKey, body_digest
from trainer.api.tinker.records import DONE, FAILED, TinkerModel, TinkerSession
from trainer.api.tinker.requests import (
    CreateModel,
    CreateSession,
    ModelRef,
    RetrieveFuture,
    SessionRef,
    WeightsInfo,
)
from trainer.checkpoint.store import CheckpointRecord
from trainer.serving.catalogue import SES_RUNNING, SessionRow
from trainer.serving.errors import ApiError, from_pydantic
from trainer.serving.ownership import owned
from trainer.serving.tenants import Principal

router = APIRouter()
CONTROL_BODY_MAX = 1 << 20  # the JSON bodies of this face carry a few fields
LONG_POLL_S = 10.0
PROTO_RESULTS = ("ForwardBackward", "Forward", "Sample")


def bridge_of(request: Request) -> TinkerBridge:
    bridge: TinkerBridge = request.app.state.tinker
    return bridge


async def parse(request: Request, model: type[BaseModel], limit: int = CONTROL_BODY_MAX) -> Any:
    body = await json_object(request, limit)
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise from_pydantic(exc) from None


def input_error(exc: convert.TinkerInputError) -> ApiError:
    return ApiError(400, str(exc), param=exc.field, code="invalid_input")


def future_json(request_id: str, model_id: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"request_id": request_id}
    if model_id is not None:
        out["model_id"] = model_id
    return out


# -- service -------------------------------------------------------------------------------


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/get_server_capabilities")
async def capabilities(request: Request) -> dict[str, Any]:
    models = bridge_of(request).worker.config.models
    return {
        "supported_models": [
            {
                "model_name": m.name,
                "max_context_length": m.max_seq_length,
                "trainable": True,
                "sampleable": True,
            }
            for m in models
        ]
    }


@router.post("/client/config")
async def client_config(request: Request) -> dict[str, Any]:
    """The SDK's feature flags: requests of a model go one at a time in `seq_id` order
    (no parallel chunks), uncompressed, over httpx; custom losses run client-side."""
    worker = bridge_of(request).worker
    chunk = min((m.max_batch_size for m in worker.config.models), default=256)
    return {
        "pjwt_auth_enabled": False,
        "parallel_fwdbwd_chunks": False,
        "proto_compress_fwdbwd": False,
        "use_pyqwest_transport": False,
        "sample_use_retrieve_futures": False,
        "custom_loss_server_side": False,
        "sample_join_sampling_session": False,
        "fwdbwd_max_chunk_len": chunk,
        "fwdbwd_max_chunk_bytes_count": worker.config.max_body_bytes // 2,
    }


@router.post("/client/dynamic_config")
async def client_dynamic_config() -> dict[str, Any]:
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}


@router.post("/telemetry")
async def telemetry() -> dict[str, str]:
    """Accepted and dropped: the worker keeps no client telemetry."""
    return {"status": "accepted"}


@router.post("/create_session")
async def create_session(request: Request) -> dict[str, Any]:
    return await start_session(request, "session_")


async def start_session(request: Request, prefix: str) -> dict[str, Any]:
    """A new Tinker session of the caller's, its id `prefix` + 32 hex digits."""
    body: CreateSession = await parse(request, CreateSession)
    now = time.time()
    session = TinkerSession(
        id=f"{prefix}{uuid.uuid4().hex}",
        created_at=now,
        heartbeat_at=now,
        display_name=body.display_name,
        user_metadata=dict(body.user_metadata or {}),
        owner=principal_of(request).user,
    )
    await run_in_threadpool(bridge_of(request).db.insert, session)
    return {"type": "create_session", "session_id": session.id}


@router.post("/session_heartbeat")
async def session_heartbeat(request: Request) -> dict[str, Any]:
    body: SessionRef = await parse(request, SessionRef)
    bridge = bridge_of(request)
    session = get_session(bridge, body.session_id, principal_of(request))
    if session.ended_at is not None:  # the SDK stops heartbeating on a 410
        raise ApiError(
            410,
            f"session_id: session {body.session_id} ended after its heartbeats stopped",
            param="session_id",
            code="session_ended",
        )
    bridge.db.update(TinkerSession, body.session_id, heartbeat_at=time.time())
    for model in bridge.db.select(TinkerModel, "tinker_session = ?", (body.session_id,)):
        bridge.worker.resources.touch(model.resource_id)
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
async def finish_session(request: Request, session_id: str) -> dict[str, Any]:
    """The SDK's `ServiceClient.close()` (and its `with` exit): acknowledged; the session's
    models stay until its heartbeats stop. Unknown session: a 404 naming `session_id`."""
    get_session(bridge_of(request), session_id, principal_of(request))
    return {}


# -- models --------------------------------------------------------------------------------


@router.post("/create_model")
async def create_model(request: Request) -> dict[str, Any]:
    """A LoRA, full-weight (`lora_config.rank` 0) or frozen base (`base_only`) model
    (`trainer.api.tinker.models`), on the job's resource when a gateway bound the request."""
    body: CreateModel = await parse(request, CreateModel)
    bridge = bridge_of(request)
    who = principal_of(request)
    binding = binding_of(request)
    get_session(bridge, body.session_id, who)
    entry = bridge.entry(body.base_model)
    plan = models.plan(body, entry, binding)
    model_id = f"{body.session_id}:train:{body.model_seq_id}"
    scope = binding.scope if binding is not None else None
    return future_json(open_model(bridge, body, plan, model_id, scope, who), model_id)


def open_model(
    bridge: TinkerBridge,
    body: CreateModel,
    plan: models.ModelPlan,
    model_id: str,
    scope: str | None,
    who: Principal,
) -> str:
    """Queue the making of model `model_id` (`plan`, its checkpoint names in name space
    `scope`: `names.scope_of`) on its dispatcher; the future's id. The Fireworks serverless
    face makes its run-scoped models through here too (`fireworks.serverless_routes`)."""

    def work(_: str) -> dict[str, Any]:
        resource_id = models.resource_of(bridge, plan, who)
        models.take_over(bridge, plan, resource_id)
        spec = models.session_spec(plan, f"tinker {model_id}")
        session_id = bridge.open_session(resource_id, spec, "create_model", who)
        now = time.time()
        bridge.db.insert(
            TinkerModel(
                id=model_id,
                tinker_session=body.session_id,
                base_model=plan.base_model,
                session_id=session_id,
                resource_id=resource_id,
                lora_rank=plan.rank,
                created_at=now,
                last_request_at=now,
                lora_config=plan.lora_config or {"rank": 0},
                user_metadata=dict(body.user_metadata or {}),
                frozen=plan.frozen,
                scope=scope,
            ),
            replace=True,
        )
        caps = models.capabilities(bridge, plan.base_model)  # R3 (docs/semantics.md §12)
        return {"model_id": model_id, "type": "create_model", **caps}

    # the model id names the request; the same id with another body is a 409
    key = RequestKey(f"create_model|{model_id}", body_digest("CreateModel", body), "model_seq_id")
    return bridge.start(model_id, "CreateModel", key, work, who)


def model_info(bridge: TinkerBridge, model: TinkerModel) -> dict[str, Any]:
    entry = bridge.worker.config.model(model.base_model)
    tokenizer = (entry.tokenizer or entry.location) if entry is not None else model.base_model
    arch = "unknown"
    if entry is not None:
        arch = entry.name.split("/")[-1].split("-")[0].lower()
    return {
        "type": "get_info",
        "model_id": model.id,
        "model_name": model.base_model,
        "is_lora": model.lora_rank > 0,
        "lora_rank": model.lora_rank,
        "frozen": model.frozen,
        "optimizer_config": {"type": "adamw"},
        "model_data": {"arch": arch, "model_name": model.base_model, "tokenizer_id": tokenizer},
    }


def get_session(bridge: TinkerBridge, session_id: str, who: Principal) -> TinkerSession:
    """A Tinker session `who` may see; another user's is missing (the same 404)."""
    return owned(bridge.db.get(TinkerSession, session_id), who, "session", session_id, "session_id")


def session_owner(bridge: TinkerBridge, session_id: str) -> str | None:
    session = bridge.db.get(TinkerSession, session_id)
    return session.owner if session is not None else None


def get_model(bridge: TinkerBridge, model_id: str, who: Principal) -> TinkerModel:
    """A model of a Tinker session `who` may see; another user's is missing (the same 404)."""
    return owned(
        bridge.db.get(TinkerModel, model_id),
        who,
        "model",
        model_id,
        "model_id",
        owner=lambda m: session_owner(bridge, m.tinker_session),
    )


def live_model(bridge: TinkerBridge, model_id: str, who: Principal) -> TinkerModel:
    """A model whose training session is running: after a restart, `unload_model` or the end
    of its Tinker session it is not, and a request for it is a 400 naming `model_id`."""
    model = get_model(bridge, model_id, who)
    row = bridge.worker.store.get(SessionRow, model.session_id)
    if row is None or row.status != SES_RUNNING:
        raise ApiError(
            400,
            f"model_id: model {model_id} is no longer loaded (the worker restarted, it was "
            "unloaded, or its session's heartbeats stopped); load it again from a checkpoint "
            "(ServiceClient.create_training_client_from_state)",
            param="model_id",
            code="failed_precondition",
        )
    return model


def seq_id_of(req: dict[str, Any]) -> int | None:
    """A request's `seq_id`: absent, or an integer (a 400 naming it otherwise)."""
    value = req.get("seq_id")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ApiError(400, "seq_id: must be an integer", param="seq_id", code="invalid_input")
    return value


@router.post("/get_info")
async def get_info(request: Request) -> dict[str, Any]:
    body: ModelRef = await parse(request, ModelRef)
    bridge = bridge_of(request)
    return model_info(bridge, get_model(bridge, body.model_id, principal_of(request)))


def described(
    bridge: TinkerBridge, path: str, who: Principal, binding: Binding | None
) -> CheckpointRecord:
    """The checkpoint `weights_info` describes: a tinker path, or a logical name as a load
    takes it (`names`; the Fireworks SDK asks with the path a save returned before it resumes
    from it in `create_training_client_from_state_with_optimizer`)."""
    if not names.is_logical(path):
        return paths.resolve(bridge, path, "tinker_path", who)
    account = names.account_of(who, binding)
    scope = binding.scope if binding is not None else None
    return names.resolve(bridge, path, "tinker_path", who, account, scope)[1]


@router.post("/weights_info")
async def weights_info(request: Request) -> dict[str, Any]:
    body: WeightsInfo = await parse(request, WeightsInfo)
    bridge = bridge_of(request)
    who = principal_of(request)
    binding = binding_of(request)
    record = await run_in_threadpool(described, bridge, body.tinker_path, who, binding)
    return {
        "base_model": record.base_model,
        "optimizer_config": {"type": "adamw"},
        "is_lora": record.lora_rank is not None,
        "lora_rank": record.lora_rank,
        "train_unembed": None,
        "train_mlp": True,
        "train_attn": True,
    }


# -- futures -------------------------------------------------------------------------------


@router.post("/retrieve_future")
async def retrieve_future(request: Request) -> Response:
    body: RetrieveFuture = await parse(request, RetrieveFuture)
    bridge = bridge_of(request)
    request_id = body.request_id
    owned(bridge.lookup(request_id), principal_of(request), "request", request_id, "request_id")

    def settled() -> bool:
        current = bridge.lookup(request_id)
        return current is not None and current.status in (DONE, FAILED)

    await bridge.waiters.wait(request_id, LONG_POLL_S, settled)
    row = bridge.lookup(request_id)
    assert row is not None
    if row.status == FAILED:
        return JSONResponse({"error": row.error or "failed", "category": row.category or "server"})
    if row.status != DONE:
        return JSONResponse(
            {"type": "try_again", "request_id": request_id, "queue_state": "active"}
        )
    result = row.result or {}
    if row.kind in PROTO_RESULTS and proto.PROTOBUF in request.headers.get("accept", ""):
        encode = (
            proto.encode_sample_response
            if row.kind == "Sample"
            else proto.encode_forward_backward_output
        )
        data = await run_in_threadpool(encode, wire_arrays(result))
        return Response(data, media_type=proto.PROTOBUF)
    return JSONResponse(result)


@router.post("/retrieve_futures")
async def retrieve_futures() -> None:
    raise ApiError(
        400,  # not 501: the SDK retries every 5xx for five minutes (face.NOT_SERVED_STATUS)
        "route /api/v1/retrieve_futures: not served (this worker sets sample_use_retrieve_futures "
        "false in /api/v1/client/config; poll /api/v1/retrieve_future)",
        code="not_implemented",
        param="route",
    )


def wire_arrays(result: dict[str, Any]) -> dict[str, Any]:
    """A stored forward-backward result (`TensorData` JSON) with numpy arrays, as the proto
    encoder takes it; a sample result passes unchanged."""
    import numpy as np

    outputs = result.get("loss_fn_outputs")
    if outputs is None:
        return result
    arrays = [
        {
            name: np.asarray(t["data"], dtype=t["dtype"]).reshape(t.get("shape") or [-1])
            for name, t in output.items()
        }
        for output in outputs
    ]
    return {**result, "loss_fn_outputs": arrays}
