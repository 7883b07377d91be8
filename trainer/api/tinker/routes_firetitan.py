"""The Tinker routes the Fireworks SDK's data plane adds or extends (its vendored Tinker 0.23
client, `FiretitanTrainingClient`; docs/semantics.md §23):

- `POST /forward`: `{forward_input, model_id, seq_id}`, the forward-only forward-backward
  (`routes_train.submit_forward_backward`, one path for both);
- `POST /load_weights`: a `tinker://` path or a logical name (`names`) into a LoRA or a
  full-weight model, weights alone or with the optimizer state;
- `GET /list_checkpoints`: `{checkpoints: [names]}`, the training states `load_state` takes;
- `POST /load_adapter`: `{adapter_path, model_id, seq_id}`, a PEFT adapter's weights into a
  LoRA model (fresh optimizer): a local directory under the worker's `resume_roots`, or a model
  name one of `TinkerBridge.model_resolvers` knows (`accounts/<a>/models/<m>`).

Each load opens the model on a new engine session and swaps it in between two requests, as
`load_state` always did.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool

from trainer.api.auth import principal_of
from trainer.api.tinker import models, names, paths
from trainer.api.tinker.binding import Binding, binding_of
from trainer.api.tinker.bridge import TinkerBridge
from trainer.api.tinker.identity import request_key
from trainer.api.tinker.records import TinkerModel
from trainer.api.tinker.requests import LoadWeights
from trainer.api.tinker.routes import (
    bridge_of,
    future_json,
    get_model,
    get_session,
    live_model,
    parse,
    seq_id_of,
)
from trainer.api.tinker.routes_train import operation_body, submit_forward_backward
from trainer.checkpoint.export import ENCRYPTED_EXPORT, stored_encrypted
from trainer.checkpoint.store import ADAPTER_DIR, TRAINING, CheckpointRecord
from trainer.contract.base import Spec
from trainer.serving.errors import ApiError, bad_request
from trainer.serving.resume import HF_FIELD, resume_location
from trainer.serving.tenants import Principal

router = APIRouter()
MODEL_NAME_PREFIX = "accounts/"


@router.post("/forward")
async def forward(request: Request) -> dict[str, Any]:
    req, as_proto = await operation_body(request)
    return await submit_forward_backward(request, req, "forward_input", True, as_proto)


@router.get("/list_checkpoints")
async def list_checkpoints(request: Request) -> dict[str, Any]:
    """A bound job's training-state names (bare), or, unbound, the caller's canonical paths:
    each is what `load_state` takes."""
    bridge = bridge_of(request)
    binding = binding_of(request)
    account = names.account_of(principal_of(request), binding)
    scope = binding.scope if binding is not None else None
    return {"checkpoints": await run_in_threadpool(names.listed, bridge, account, scope)}


# -- load_weights ----------------------------------------------------------------------------


def _checkpoint(
    bridge: TinkerBridge, path: str, who: Principal, account: str, scope: str | None
) -> CheckpointRecord:
    """The engine checkpoint a load's `path` names (a tinker path or a logical name)."""
    if not names.is_logical(path):
        return paths.loadable(bridge, path, "path", who)
    _, record = names.resolve(bridge, path, "path", who, account, scope)
    if stored_encrypted(bridge.worker.checkpoints, record.id):
        raise bad_request(f"path: {path} {ENCRYPTED_EXPORT}", "path")
    return record


def _check_kind(record: CheckpointRecord, path: str, full: bool, what: str) -> None:
    """A full-weight checkpoint loads into full weights only, a LoRA one into LoRA only."""
    if (record.lora_rank is None) != full:
        saved = "full-weight" if record.lora_rank is None else "LoRA"
        raise bad_request(f"path: {path} is a {saved} checkpoint; {what}", "path")


@router.post("/load_weights")
async def load_weights(request: Request) -> dict[str, Any]:
    body: LoadWeights = await parse(request, LoadWeights)
    bridge = bridge_of(request)
    who = principal_of(request)
    binding = binding_of(request)
    account = names.account_of(who, binding)
    old = get_model(bridge, body.model_id, who) if body.model_id is not None else None
    if old is not None:
        models.check_trainable(old, "load_weights")
    scope = names.scope_of(old) if old is not None else binding.scope if binding else None
    record = await run_in_threadpool(_checkpoint, bridge, body.path, who, account, scope)
    if body.optimizer and record.type != TRAINING:
        raise bad_request("optimizer: a sampler checkpoint has no optimizer state", "optimizer")
    full = record.lora_rank is None
    if old is not None:
        if record.base_model != old.base_model:
            raise bad_request(
                f"path: {body.path} was trained on {record.base_model!r}, model {old.id} on "
                f"{old.base_model!r}",
                "path",
            )
        _check_kind(record, body.path, models.is_full(old), f"model {old.id} is not")
        target, tinker_session, base_model = old.id, old.tinker_session, old.base_model
    else:
        tinker_session = body.session_id or ""
        get_session(bridge, tinker_session, who)
        base_model = bridge.entry(record.base_model, "path").name
        target = f"{tinker_session}:train:{body.model_seq_id}"
        if binding is not None:
            _check_kind(record, body.path, binding.lora_rank == 0, "the job is not")
    spec = {
        "resume_from_checkpoint_id": record.id,
        "load_optimizer": body.optimizer,
        "display_name": f"tinker {target}"[:128],
    }
    lora_rank = 0 if full else int(record.lora_rank or 0)
    plan = models.ModelPlan(
        "full" if full else "lora",
        base_model,
        None if full else {"rank": lora_rank, "alpha": models.LORA_ALPHA},
        binding is not None and binding.forward_only,
        binding,
    )

    def work(_: str) -> dict[str, Any]:
        _swap(bridge, target, tinker_session, plan, spec, who, body.user_metadata)
        return {"path": body.path, "model_id": target, "type": "load_weights"}

    key = request_key(request, target, "LoadWeights", body.seq_id, body)
    return future_json(bridge.start(target, "LoadWeights", key, work, who), target)


def _swap(
    bridge: TinkerBridge,
    target: str,
    tinker_session: str,
    plan: models.ModelPlan,
    spec: dict[str, Any],
    who: Principal,
    user_metadata: dict[str, Any] | None = None,
) -> None:
    """Open model `target` on a new session (`spec`) and record it in place of the old one,
    which closes: before the new one opens on a full-weight resource (one session each)."""
    old = bridge.db.get(TinkerModel, target)
    if plan.kind == "full" and old is not None and models.is_full(old) and plan.binding is None:
        bridge.stop_session(old.session_id)  # its own resource hosts the new session
        resource_id = _reuse(bridge, old.resource_id) or models.resource_of(bridge, plan, who)
    else:
        resource_id = models.resource_of(bridge, plan, who)
        models.take_over(bridge, plan, resource_id)  # a bound full job: its one session
    session_id = bridge.open_session(resource_id, spec, "path", who)
    now = time.time()
    binding: Binding | None = plan.binding
    model = TinkerModel(
        id=target,
        tinker_session=tinker_session,
        base_model=plan.base_model,
        session_id=session_id,
        resource_id=resource_id,
        lora_rank=plan.rank,
        created_at=old.created_at if old is not None else now,
        last_request_at=now,
        lora_config=plan.lora_config or {"rank": 0},
        user_metadata=old.user_metadata if old is not None else dict(user_metadata or {}),
        frozen=plan.frozen,
        scope=old.scope if old is not None else binding.scope if binding else None,
    )
    bridge.db.insert(model, replace=True)
    if old is not None:
        bridge.stop_session(old.session_id)


def _reuse(bridge: TinkerBridge, resource_id: str) -> str | None:
    """A model's own full-weight resource, while it is live."""
    live = bridge.worker.resources.get_live(resource_id)
    return resource_id if live is not None and not live.stopped else None


# -- load_adapter ----------------------------------------------------------------------------


class LoadAdapter(Spec):
    model_id: str
    adapter_path: str
    seq_id: int | None = None


def adapter_source(
    bridge: TinkerBridge, adapter_path: str, who: Principal
) -> tuple[str, dict[str, Any]]:
    """The PEFT directory `adapter_path` names for `who`, and what the new session resumes
    from (`resume_from_*`): a model name a resolver knows (its adapter: a checkpoint's, read by
    id, weights only), or a local directory the worker may read; a 400 naming `adapter_path`
    otherwise (another user's model name answers as a missing one)."""
    for resolve in bridge.model_resolvers:
        found = resolve(adapter_path.strip(), who)
        if found is not None:
            return str(found), _resolved(bridge, found)
    location = adapter_dir(bridge, adapter_path)
    return location, {"resume_from_hf_checkpoint": location}


def _resolved(bridge: TinkerBridge, found: Path) -> dict[str, Any]:
    """A resolver's directory: a checkpoint's adapter (`<checkpoint>/adapter`) resumes by the
    checkpoint's id (a directory in the worker's storage is never read by path), any other
    directory by its path."""
    store = bridge.worker.checkpoints
    record = store.get(found.parent.name) if found.name == ADAPTER_DIR else None
    if record is not None and Path(record.path).resolve() == found.parent.resolve():
        return {"resume_from_checkpoint_id": record.id, "load_optimizer": False}
    return {"resume_from_hf_checkpoint": str(found)}


def adapter_dir(bridge: TinkerBridge, adapter_path: str) -> str:
    """A local PEFT directory under the worker's `resume_roots` (400s name `adapter_path`)."""
    field = "adapter_path"
    text = adapter_path.strip()
    if text.startswith(MODEL_NAME_PREFIX):
        raise bad_request(f"{field}: no model named {text[:200]!r} on this worker", field)
    if "://" in text and not text.lower().startswith("file://"):
        raise bad_request(
            f"{field}: {text[:200]!r}: only local directories (under the worker's resume_roots) "
            "and model names (accounts/<account>/models/<model>) are read here",
            field,
        )
    if not (text.startswith(("/", "file://"))):
        raise bad_request(f"{field}: {text[:200]!r} is not an absolute local path", field)
    config = bridge.worker.config
    try:
        location = resume_location(text, config.storage, list(config.resume_roots))
    except ApiError as exc:
        message = exc.message.replace(HF_FIELD, field)
        raise ApiError(exc.status, message, param=field, code=exc.code) from None
    if not (Path(location) / "adapter_config.json").is_file():
        raise bad_request(f"{field}: {text[:200]!r} holds no PEFT adapter_config.json", field)
    return location


def _adapter_lora(location: str) -> dict[str, Any]:
    try:
        config = json.loads((Path(location) / "adapter_config.json").read_text())
    except (OSError, ValueError):
        config = {}
    rank = config.get("r") if isinstance(config, dict) else None
    alpha = config.get("lora_alpha") if isinstance(config, dict) else None
    return {"rank": rank if isinstance(rank, int) else 0, "alpha": alpha}


@router.post("/load_adapter")
async def load_adapter(request: Request) -> dict[str, Any]:
    """A PEFT adapter's weights into a LoRA model: its session starts again from them, with a
    fresh optimizer (`adapter_source`)."""
    body: LoadAdapter = await parse(request, LoadAdapter)
    bridge = bridge_of(request)
    who = principal_of(request)
    model = live_model(bridge, body.model_id, who)
    models.check_trainable(model, "load_adapter")
    if model.lora_rank == 0:
        raise bad_request(
            f"model_id: model {model.id} trains full weights; load_adapter needs a LoRA model",
            "model_id",
        )
    location, source = await run_in_threadpool(adapter_source, bridge, body.adapter_path, who)
    lora = _adapter_lora(location)
    plan = models.ModelPlan("lora", model.base_model, lora, False, binding_of(request))
    spec = {**source, "display_name": f"tinker {model.id}"[:128]}
    binding = binding_of(request)
    if binding is not None and lora["rank"] > binding.lora_rank:
        raise bad_request(
            f"adapter_path: the adapter's rank {lora['rank']} exceeds the job's lora_rank "
            f"{binding.lora_rank}",
            "adapter_path",
        )

    def work(_: str) -> dict[str, Any]:
        _swap(bridge, model.id, model.tinker_session, plan, spec, who)
        return {"model_id": model.id, "adapter_path": body.adapter_path, "type": "load_adapter"}

    key = request_key(request, model.id, "LoadAdapter", seq_id_of(body.model_dump()), body)
    return future_json(bridge.start(model.id, "LoadAdapter", key, work, who), model.id)
