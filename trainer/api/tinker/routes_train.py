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
from trainer.api.tinker import convert, paths, proto, stability
from trainer.api.tinker.bridge import RequestFailed, TinkerBridge
from trainer.api.tinker.identity import RequestKey, request_key
from trainer.api.tinker.records import TinkerCheckpoint, TinkerModel
from trainer.api.tinker.requests import (
    LoadWeights,
    ModelRef,
    SaveWeights,
    SaveWeightsExternal,
    SaveWeightsForSampler,
)
from trainer.api.tinker.routes import (
    LORA_ALPHA,
    bridge_of,
    future_json,
    get_model,
    get_session,
    input_error,
    live_model,
    parse,
    seq_id_of,
)
from trainer.api.tinker.sampling import SamplerSessions, new_sampler, samplers_of
from trainer.checkpoint.export import AdapterExport
from trainer.serving.errors import ApiError, bad_request
from trainer.serving.operations import vocab_size_of

router = APIRouter()


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


@router.post("/forward_backward")
async def forward_backward(request: Request) -> dict[str, Any]:
    bridge = bridge_of(request)
    who = principal_of(request)
    limit = bridge.worker.config.max_body_bytes
    as_proto = proto.PROTOBUF in request.headers.get("content-type", "")
    if as_proto:
        if request.headers.get("content-encoding", "identity") not in ("identity", ""):
            raise bad_request(
                "Content-Encoding: compressed bodies are not accepted (client/config sets "
                "proto_compress_fwdbwd false)",
                "Content-Encoding",
            )
        # decoded within the models' bounds, off the event loop (large: in the body parser)
        req = await json_object(request, limit, arrays=True, decoder=proto.DECODER)
    else:
        req = await json_object(request, limit, arrays=True)
    model_id = req.get("model_id")
    if not isinstance(model_id, str) or not model_id:
        raise bad_request("model_id: required", "model_id")
    model = live_model(bridge, model_id, who)
    fbi = req.get("forward_backward_input")
    if not isinstance(fbi, dict):
        raise bad_request("forward_backward_input: required (an object)", "forward_backward_input")
    forward_only = req.get("forward_only", False)
    vocab = vocab_size_of(bridge.worker, model.base_model)
    try:
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
                "forward_backward_input.data",
            )
    except convert.TinkerInputError as exc:
        raise input_error(exc) from None
    forward_only = body["forward_only"]
    call = await run_in_threadpool(bridge.prepare, model.session_id, "forward-backward", body)
    kind = "Forward" if forward_only else "ForwardBackward"
    loss_fn = str(fbi.get("loss_fn", ""))
    seq_id = seq_id_of(req)
    if as_proto and seq_id == 0:  # proto3 cannot tell 0 from absent; the SDK counts from 1
        seq_id = None
    asked = {"loss_fn": loss_fn, "body": body}
    key = await run_in_threadpool(request_key, request, model_id, kind, seq_id, asked)

    def work(request_id: str) -> dict[str, Any]:
        result = bridge.run(model, "forward-backward", call, request_id)
        return storable_fb(convert.forward_backward_output(result, loss_fn))

    return future_json(bridge.start(model_id, kind, key, work, who), model_id)


@router.post("/optim_step")
async def optim_step(request: Request) -> dict[str, Any]:
    bridge = bridge_of(request)
    who = principal_of(request)
    req = await json_object(request, 1 << 20)
    model = live_model(bridge, str(req.get("model_id") or ""), who)
    try:
        body = convert.optim_step_body(req)
    except convert.TinkerInputError as exc:
        raise input_error(exc) from None
    call = await run_in_threadpool(bridge.prepare, model.session_id, "optim-step", body)
    key = request_key(request, model.id, "OptimStep", seq_id_of(req), body)

    def work(request_id: str) -> dict[str, Any]:
        return convert.optim_step_output(bridge.run(model, "optim-step", call, request_id))

    return future_json(bridge.start(model.id, "OptimStep", key, work, who), model.id)


def _checkpoint_name(bridge: TinkerBridge, model: TinkerModel, kind: str, name: str | None) -> str:
    if name is None:
        count = bridge.db.count(TinkerCheckpoint, "run_id = ? AND kind = ?", (model.id, kind))
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
) -> str:
    """Write the checkpoint (training, inference, or with `export` an adapter export) and
    record its tinker path."""
    path = paths.make(model.id, kind, name)
    existing = bridge.db.get(TinkerCheckpoint, path)
    if existing is not None and not overwrite:
        raise RequestFailed(f"path: checkpoint {path} exists (pass overwrite=True to replace it)")
    op = (
        "training-checkpoint" if kind == "training" else "inference-checkpoint"
    )  # sampler, external
    extra = None if export is None else {"export": export}
    call = bridge.prepare(bridge.current_session(model.id), op, {}, extra)
    output = bridge.run(model, op, call, future_id)
    checkpoint_id = str((output.get("checkpoint") or {}).get("id") or "")
    if not checkpoint_id:
        raise RequestFailed(f"{op} returned no checkpoint id: {sorted(output)}", "server")
    now = time.time()
    bridge.db.insert(
        TinkerCheckpoint(
            path=path,
            run_id=model.id,
            kind=kind,
            name=name,
            checkpoint_id=checkpoint_id,
            created_at=now,
            expires_at=now + ttl_seconds if ttl_seconds else None,
            user_metadata=user_metadata,
        ),
        replace=True,
    )
    return path


def _save_request(
    request: Request, body: SaveWeights | SaveWeightsForSampler, kind: str, op: str
) -> tuple[TinkerBridge, TinkerModel, str, RequestKey]:
    """What a save route needs first: its model, the checkpoint's name, the request's key."""
    bridge = bridge_of(request)
    who = principal_of(request)
    model = live_model(bridge, body.model_id, who)
    name = _checkpoint_name(bridge, model, kind, body.path)
    return bridge, model, name, request_key(request, model.id, op, body.seq_id, body)


@router.post("/save_weights")
async def save_weights(request: Request) -> dict[str, Any]:
    body: SaveWeights = await parse(request, SaveWeights)
    bridge, model, name, key = _save_request(request, body, "training", "SaveWeights")
    who = principal_of(request)

    def work(request_id: str) -> dict[str, Any]:
        path = _save(
            bridge,
            model,
            "training",
            name,
            request_id,
            body.ttl_seconds,
            body.user_metadata,
            body.overwrite,
        )
        return {"path": path, "type": "save_weights"}

    return future_json(bridge.start(model.id, "SaveWeights", key, work, who), model.id)


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(request: Request) -> dict[str, Any]:
    body: SaveWeightsForSampler = await parse(request, SaveWeightsForSampler)
    bridge, model, name, key = _save_request(request, body, "sampler", "SaveWeightsForSampler")
    who = principal_of(request)
    samplers = samplers_of(request)

    def work(request_id: str) -> dict[str, Any]:
        path = _save(
            bridge, model, "sampler", name, request_id, body.ttl_seconds, body.user_metadata, True
        )
        _publish_for_samplers(samplers, bridge, model, path, request_id)
        out: dict[str, Any] = {"path": path, "type": "save_weights_for_sampler"}
        if body.sampling_session_seq_id is not None:
            sampler_id = f"{model.tinker_session}:sample:{body.sampling_session_seq_id}"
            new_sampler(bridge, sampler_id, model.tinker_session, model.base_model, path, who)
            out["sampling_session_id"] = sampler_id
        return out

    return future_json(bridge.start(model.id, "SaveWeightsForSampler", key, work, who), model.id)


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
        )
        record = paths.resolve(bridge, path, "path", who)
        files = bridge.worker.checkpoints.variant_files(record.id, "ADAPTER")
        size = sum(f.size for f in files)
        return {"path": path, "size_bytes": size, "type": "save_weights_external"}

    return future_json(bridge.start(model.id, "SaveWeightsExternal", key, work, who), model.id)


@router.post("/load_weights")
async def load_weights(request: Request) -> dict[str, Any]:
    body: LoadWeights = await parse(request, LoadWeights)
    bridge = bridge_of(request)
    who = principal_of(request)
    record = await run_in_threadpool(paths.loadable, bridge, body.path, "path", who)
    if record.lora_rank is None:
        raise bad_request(
            f"path: {body.path} is a full-weight checkpoint; Tinker models are LoRA", "path"
        )
    if body.optimizer and record.type != paths.ENGINE_TYPES["training"]:
        raise bad_request("optimizer: a sampler checkpoint has no optimizer state", "optimizer")
    if body.model_id is not None:
        model = get_model(bridge, body.model_id, who)
        if record.base_model != model.base_model:
            raise bad_request(
                f"path: {body.path} was trained on {record.base_model!r}, model {model.id} on "
                f"{model.base_model!r}",
                "path",
            )
        target, tinker_session, base_model = model.id, model.tinker_session, model.base_model
    else:
        tinker_session = body.session_id or ""
        get_session(bridge, tinker_session, who)
        base_model = bridge.entry(record.base_model, "path").name
        target = f"{tinker_session}:train:{body.model_seq_id}"
    spec = {
        "resume_from_checkpoint_id": record.id,
        "load_optimizer": body.optimizer,
        "display_name": f"tinker {target}"[:128],
    }

    def work(_: str) -> dict[str, Any]:
        old = bridge.db.get(TinkerModel, target)
        # the face's live resource (made again if the model's own was stopped or restarted)
        resource_id = bridge.resource_for(base_model)
        session_id = bridge.open_session(resource_id, spec, "path", who)
        now = time.time()
        model = TinkerModel(
            id=target,
            tinker_session=tinker_session,
            base_model=base_model,
            session_id=session_id,
            resource_id=resource_id,
            lora_rank=int(record.lora_rank or 0),
            created_at=old.created_at if old is not None else now,
            last_request_at=now,
            lora_config={"rank": record.lora_rank, "alpha": LORA_ALPHA},
            user_metadata=old.user_metadata if old is not None else dict(body.user_metadata or {}),
        )
        bridge.db.insert(model, replace=True)
        if old is not None:
            bridge.stop_session(old.session_id)
        return {"path": body.path, "model_id": target, "type": "load_weights"}

    key = request_key(request, target, "LoadWeights", body.seq_id, body)
    return future_json(bridge.start(target, "LoadWeights", key, work, who), target)


@router.post("/unload_model")
async def unload_model(request: Request) -> dict[str, Any]:
    body: ModelRef = await parse(request, ModelRef)
    bridge = bridge_of(request)
    who = principal_of(request)
    model = get_model(bridge, body.model_id, who)
    # unloading the session that holds the model now is one request, however often it is sent
    key = request_key(request, model.id, "UnloadModel", model.session_id, body)

    def work(_: str) -> dict[str, Any]:
        bridge.stop_session(bridge.current_session(model.id))
        return {"model_id": model.id, "type": "unload_model"}

    return future_json(bridge.start(model.id, "UnloadModel", key, work, who), model.id)
