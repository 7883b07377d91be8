"""The Tinker training routes: `forward_backward` (also the SDK's `forward`), `optim_step`,
`save_weights`, `save_weights_for_sampler`, `load_weights` and `unload_model`.

Each answers a future at once and runs on the model's dispatcher (`TinkerBridge.dispatch`), so
a model's requests run in the order they arrived. Bodies are translated to the engine's own
operation bodies (`trainer.api.tinker.convert`) and validated against the model's limits
before the future exists: bad input is a 400 naming the field, never a failed future.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool

from trainer.api.auth import principal_of
from trainer.api.http import json_object
from trainer.api.tinker import convert, names, paths, proto, stability
from trainer.api.tinker.binding import binding_of
from trainer.api.tinker.bridge import RequestFailed, TinkerBridge
from trainer.api.tinker.convert import FBI
from trainer.api.tinker.convert_embeddings import embedding_body, embedding_output, is_embedding
from trainer.api.tinker.identity import RequestKey, request_key
from trainer.api.tinker.models import check_trainable
from trainer.api.tinker.records import TinkerCheckpoint, TinkerModel
from trainer.api.tinker.requests import (
    ModelRef,
    SaveWeights,
    SaveWeightsExternal,
    SaveWeightsForSampler,
)
from trainer.api.tinker.routes import (
    bridge_of,
    future_json,
    get_model,
    input_error,
    live_model,
    parse,
    seq_id_of,
)
from trainer.api.tinker.sampling import SamplerSessions, new_sampler, samplers_of
from trainer.checkpoint.export import AdapterExport
from trainer.contract.exports import QUANTIZED, WRITTEN
from trainer.serving.errors import ApiError, bad_request
from trainer.serving.operations import hidden_size_of, vocab_size_of

router = APIRouter()
EMBEDDING_OP = "embedding-forward-backward"


def tensor_json(value: Any) -> dict[str, Any]:
    array = np.asarray(value)
    dtype = "int64" if array.dtype.kind in "iu" else "float32"
    return {
        "data": array.reshape(-1).astype(dtype).tolist(),
        "dtype": dtype,
        "shape": list(array.shape),
    }


def storable_fb(out: dict[str, Any]) -> dict[str, Any]:
    """A translated forward-backward output with its arrays as `TensorData` JSON."""
    return {
        "loss_fn_output_type": out.get("loss_fn_output_type", "ArrayRecord"),
        "loss_fn_outputs": [
            {name: tensor_json(value) for name, value in output.items()}
            for output in out["loss_fn_outputs"]
        ],
        "metrics": {k: float(v) for k, v in out.get("metrics", {}).items()},
    }


async def operation_body(request: Request) -> tuple[dict[str, Any], bool]:
    """A forward(-backward) body, JSON or protobuf (within the models' bounds, off the event
    loop), and whether it came as protobuf."""
    limit = bridge_of(request).worker.config.max_body_bytes
    as_proto = proto.PROTOBUF in request.headers.get("content-type", "")
    if as_proto:
        if request.headers.get("content-encoding", "identity") not in ("identity", ""):
            raise bad_request(
                "Content-Encoding: compressed bodies are not accepted (client/config sets "
                "proto_compress_fwdbwd false)",
                "Content-Encoding",
            )
        # decoded within the models' bounds, off the event loop (large: in the body parser)
        return await json_object(request, limit, arrays=True, decoder=proto.DECODER), True
    return await json_object(request, limit, arrays=True), False


def _renamed(exc: ApiError, field: str) -> ApiError:
    """`exc` naming `field` (the SDK's `forward_input`) for `forward_backward_input`."""
    if field == FBI:
        return exc
    param = None if exc.param is None else exc.param.replace(FBI, field)
    return ApiError(exc.status, exc.message.replace(FBI, field), param=param, code=exc.code)


@router.post("/forward_backward")
async def forward_backward(request: Request) -> dict[str, Any]:
    req, as_proto = await operation_body(request)
    return await submit_forward_backward(
        request, req, FBI, req.get("forward_only", False), as_proto
    )


async def submit_forward_backward(
    request: Request, req: dict[str, Any], field: str, forward_only: Any, as_proto: bool = False
) -> dict[str, Any]:
    """The one path of `forward_backward` and the Fireworks SDK's `forward` (its input under
    `field`, `forward_only` true), and of the SDK's embedding outputs (the engine's
    `embedding-forward-backward`): translated, validated and queued on the model's
    dispatcher; a 400 names the request's own fields."""
    bridge = bridge_of(request)
    who = principal_of(request)
    model_id = req.get("model_id")
    if not isinstance(model_id, str) or not model_id:
        raise bad_request("model_id: required", "model_id")
    model = live_model(bridge, model_id, who)
    fbi = req.get(field)
    if not isinstance(fbi, dict):
        raise bad_request(f"{field}: required (an object)", field)
    vocab = vocab_size_of(bridge.worker, model.base_model)
    try:
        if is_embedding(fbi):  # the Fireworks SDK's embedding outputs (convert_embeddings)
            op, loss_fn = EMBEDDING_OP, "embedding"
            hidden = hidden_size_of(bridge.worker, model.base_model)
            body = await run_in_threadpool(embedding_body, fbi, forward_only, vocab, hidden)
        else:
            op, loss_fn = "forward-backward", str(fbi.get("loss_fn", ""))
            body, provenance = await run_in_threadpool(
                convert.forward_backward_request, fbi, forward_only, vocab
            )
            if provenance is not None:  # stable_reinforce: the records its spans name
                body = await run_in_threadpool(
                    stability.resolve,
                    bridge.stability,
                    model.tinker_session,
                    body,
                    provenance,
                    f"{FBI}.data",
                )
    except convert.TinkerInputError as exc:
        raise _renamed(input_error(exc), field) from None
    forward_only = body["forward_only"]
    if not forward_only:
        check_trainable(model, "forward_backward")
    try:
        call = await run_in_threadpool(bridge.prepare, model.session_id, op, body)
    except ApiError as exc:
        raise _renamed(exc, field) from None
    kind = "Forward" if forward_only else "ForwardBackward"
    seq_id = seq_id_of(req)
    if as_proto and seq_id == 0:  # proto3 cannot tell 0 from absent; the SDK counts from 1
        seq_id = None
    asked = {"loss_fn": loss_fn, "body": body}
    key = await run_in_threadpool(request_key, request, model_id, kind, seq_id, asked)
    count = len(body["samples"])

    def work(request_id: str) -> dict[str, Any]:
        result = bridge.run(model, op, call, request_id)
        if op == EMBEDDING_OP:
            return storable_fb(embedding_output(result, count))
        return storable_fb(convert.forward_backward_output(result, loss_fn))

    return future_json(bridge.start(model_id, kind, key, work, who), model_id)


@router.post("/optim_step")
async def optim_step(request: Request) -> dict[str, Any]:
    bridge = bridge_of(request)
    who = principal_of(request)
    req = await json_object(request, 1 << 20)
    model = live_model(bridge, str(req.get("model_id") or ""), who)
    check_trainable(model, "optim_step")
    try:
        body = convert.optim_step_body(req)
        normalization = convert.grad_normalization(req)
    except convert.TinkerInputError as exc:
        raise input_error(exc) from None
    extra = {"grad_accumulation_normalization": normalization}
    call = await run_in_threadpool(bridge.prepare, model.session_id, "optim-step", body, extra)
    asked = {**body, "grad_accumulation_normalization": normalization} if normalization else body
    key = request_key(request, model.id, "OptimStep", seq_id_of(req), asked)

    def work(request_id: str) -> dict[str, Any]:
        return convert.optim_step_output(bridge.run(model, "optim-step", call, request_id))

    return future_json(bridge.start(model.id, "OptimStep", key, work, who), model.id)


def _checkpoint_name(bridge: TinkerBridge, model: TinkerModel, kind: str, name: str | None) -> str:
    if name is None:
        count = bridge.db.count(
            TinkerCheckpoint, "run_id = ? AND kind = ? AND scope IS NULL", (model.id, kind)
        )
        return f"{count:06d}"
    return paths.check_name(name, "path")


def _save(
    bridge: TinkerBridge,
    model: TinkerModel,
    kind: str,
    name: str,
    future_id: str,
    ttl_seconds: int | None,
    user_metadata: dict[str, str] | None,
    overwrite: bool,
    export: AdapterExport | None = None,
    merged: bool = False,
    precision: str | None = None,
    decision: dict[str, Any] | None = None,
) -> TinkerCheckpoint:
    """Write the checkpoint (training, inference, or with `export` an adapter export) and
    record its tinker path (`merged`: a `merged_base` sampler save, its merged model at
    `precision`; `decision`: its `decision.json`); the record."""
    path = paths.make(model.id, kind, name)
    existing = bridge.db.get(TinkerCheckpoint, path)
    if existing is not None and not overwrite:
        raise RequestFailed(f"path: checkpoint {path} exists (pass overwrite=True to replace it)")
    op = (
        "training-checkpoint" if kind == "training" else "inference-checkpoint"
    )  # sampler, external
    extra: dict[str, Any] = {} if export is None else {"export": export}
    if merged:
        extra.update(merged=True, precision=precision)
    if decision is not None:
        extra["decision"] = decision
    call = bridge.prepare(bridge.current_session(model.id), op, {}, extra)
    output = bridge.run(model, op, call, future_id)
    checkpoint_id = str((output.get("checkpoint") or {}).get("id") or "")
    if not checkpoint_id:
        raise RequestFailed(f"{op} returned no checkpoint id: {sorted(output)}", "server")
    now = time.time()
    saved = TinkerCheckpoint(
        path=path,
        run_id=model.id,
        kind=kind,
        name=name,
        checkpoint_id=checkpoint_id,
        created_at=now,
        expires_at=now + ttl_seconds if ttl_seconds else None,
        user_metadata=user_metadata,
        merged=merged,
    )
    bridge.db.insert(saved, replace=True)
    return saved


def _save_request(
    request: Request, body: SaveWeights | SaveWeightsForSampler, kind: str, op: str
) -> tuple[TinkerBridge, TinkerModel, str, RequestKey]:
    """What a save route needs first: its model (not frozen), the checkpoint's name (a DNS
    label for the Fireworks SDK, `names`), the request's key."""
    bridge = bridge_of(request)
    who = principal_of(request)
    model = live_model(bridge, body.model_id, who)
    check_trainable(model, op.lower())
    name = _checkpoint_name(bridge, model, kind, body.path)
    if firetitan(request):
        names.check_label(name, "path")
    return bridge, model, name, request_key(request, model.id, op, body.seq_id, body)


def firetitan(request: Request) -> bool:
    """The Fireworks SDK's data plane (bound by a gateway, or its vendored Tinker 0.23
    client): checkpoints answer with their logical names (`names`)."""
    agent = request.headers.get("user-agent", "")
    return binding_of(request) is not None or agent.startswith(names.FIRETITAN_AGENT)


def _named(bridge: TinkerBridge, account: str, model: TinkerModel, saved: TinkerCheckpoint) -> str:
    """Record a saved checkpoint's logical name when it is one; the logical path."""
    if not names.DNS_LABEL.fullmatch(saved.name):
        return saved.path
    return names.record(
        bridge, account, model, saved.kind, saved.name, saved.checkpoint_id, saved.merged
    )


@router.post("/save_weights")
async def save_weights(request: Request) -> dict[str, Any]:
    body: SaveWeights = await parse(request, SaveWeights)
    bridge, model, name, key = _save_request(request, body, "training", "SaveWeights")
    who = principal_of(request)
    account, logical = names.account_of(who, binding_of(request)), firetitan(request)

    def work(request_id: str) -> dict[str, Any]:
        saved = _save(
            bridge,
            model,
            "training",
            name,
            request_id,
            body.ttl_seconds,
            body.user_metadata,
            body.overwrite or logical,  # the Fireworks SDK: a name saved again is replaced
        )
        named = _named(bridge, account, model, saved)
        return {"path": named if logical else saved.path, "type": "save_weights"}

    return future_json(bridge.start(model.id, "SaveWeights", key, work, who), model.id)


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(request: Request) -> dict[str, Any]:
    body: SaveWeightsForSampler = await parse(request, SaveWeightsForSampler)
    bridge, model, name, key = _save_request(request, body, "sampler", "SaveWeightsForSampler")
    who = principal_of(request)
    samplers = samplers_of(request)
    account, logical = names.account_of(who, binding_of(request)), firetitan(request)
    merged = body.checkpoint_type == "merged_base"
    if merged and not model.lora_rank:
        raise bad_request(
            "checkpoint_type: 'merged_base' folds a LoRA adapter into the base weights; a "
            "full-weight model saves 'base'",
            "checkpoint_type",
        )
    precision = _export_precision(body.export_precision, merged)
    calibration = body.metadata.decision_calibration if body.metadata else None
    decision = None if calibration is None else calibration.model_dump(mode="json")

    def work(request_id: str) -> dict[str, Any]:
        saved = _save(
            bridge,
            model,
            "sampler",
            name,
            request_id,
            body.ttl_seconds,
            body.user_metadata,
            True,
            merged=merged,
            precision=precision,
            decision=decision,
        )
        path = saved.path
        _publish_for_samplers(samplers, bridge, model, path, request_id)
        named = _named(bridge, account, model, saved)
        out: dict[str, Any] = {
            "path": named if logical else path,
            "type": "save_weights_for_sampler",
        }
        if body.checkpoint_type is not None:  # docs/semantics.md §23: every type is whole
            out["checkpoint_type"] = body.checkpoint_type
            out["stored_as"] = "whole"
        if body.sampling_session_seq_id is not None:
            sampler_id = f"{model.tinker_session}:sample:{body.sampling_session_seq_id}"
            new_sampler(bridge, sampler_id, model.tinker_session, model.base_model, path, who)
            out["sampling_session_id"] = sampler_id
        return out

    return future_json(bridge.start(model.id, "SaveWeightsForSampler", key, work, who), model.id)


def _export_precision(value: str | None, merged: bool) -> str | None:
    """The precision a sampler save writes its merged model at: a `merged_base` save's
    `export_precision` (default `source`); any other save has none (docs/semantics.md §23)."""
    if value is None:
        return "source" if merged else None
    wanted = value.lower()
    if not merged:
        raise bad_request(
            "export_precision: only a checkpoint_type='merged_base' save has one",
            "export_precision",
        )
    if wanted in QUANTIZED:
        raise bad_request(
            f"export_precision: {value!r} is a quantized format, which this worker does not "
            "write; use 'source' or 'bf16'",
            "export_precision",
        )
    if wanted not in WRITTEN:
        allowed = ", ".join((*WRITTEN, *QUANTIZED))
        raise bad_request(
            f"export_precision: {value[:64]!r} is not one of {allowed}", "export_precision"
        )
    return wanted


def _publish_for_samplers(
    samplers: SamplerSessions, bridge: TinkerBridge, model: TinkerModel, path: str, request_id: str
) -> None:
    """The training session publishes the weights just saved, so samplers of this checkpoint
    sample on it (`sampling.SamplerSessions.bind`); a session without a generator keeps the
    checkpoint-session path."""
    session_id = bridge.current_session(model.id)
    body = {"weight_sync_type": "WEIGHT_SYNC_TYPE_SYNCHRONOUS"}
    try:
        call = bridge.prepare(session_id, "weights-sync", body)
        out = bridge.run(model, "weights-sync", call, f"{request_id}:publish")
    except (ApiError, RequestFailed):
        return
    record = bridge.db.get(TinkerCheckpoint, path)
    if record is not None:
        samplers.bind(record.checkpoint_id, session_id, int(out["weights_version"]))


@router.post("/save_weights_external")
async def save_weights_external(request: Request) -> dict[str, Any]:
    """The model's LoRA adapter alone, in Tinker's naming (`checkpoint/export.py`), under
    `external_weights/<name>`, downloadable through `external_weights_urls`; with
    `age_encryption_recipients`, every file encrypted to them as `<name>.age`."""
    body: SaveWeightsExternal = await parse(request, SaveWeightsExternal)
    bridge = bridge_of(request)
    who = principal_of(request)
    model = live_model(bridge, body.model_id, who)
    name = paths.check_name(body.path, "path")
    key = request_key(request, model.id, "SaveWeightsExternal", body.seq_id, body)
    export = AdapterExport("tinker", tuple(body.age_encryption_recipients or ()))

    def work(request_id: str) -> dict[str, Any]:
        path = _save(
            bridge, model, "external", name, request_id, body.ttl_seconds, None, True, export
        ).path
        record = paths.resolve(bridge, path, "path", who)
        files = bridge.worker.checkpoints.variant_files(record.id, "ADAPTER")
        size = sum(f.size for f in files)
        return {"path": path, "size_bytes": size, "type": "save_weights_external"}

    return future_json(bridge.start(model.id, "SaveWeightsExternal", key, work, who), model.id)


@router.post("/unload_model")
async def unload_model(request: Request) -> dict[str, Any]:
    body: ModelRef = await parse(request, ModelRef)
    bridge = bridge_of(request)
    who = principal_of(request)
    model = get_model(bridge, body.model_id, who)
    # unloading the session that holds the model now is one request, however often it is sent
    key = request_key(request, model.id, "UnloadModel", model.session_id, body)

    def work(_: str) -> dict[str, Any]:
        current = bridge.db.get(TinkerModel, model.id)
        bridge.release(current or model)
        return {"model_id": model.id, "type": "unload_model"}

    return future_json(bridge.start(model.id, "UnloadModel", key, work, who), model.id)
