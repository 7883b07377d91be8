"""The serverless surface's own Tinker routes, under `/training/v1/serverless/api/v1`
(`serverless.ServerlessGateway` sends every other route there to the Tinker face):

- `create_session`: a Tinker session whose id is `ts-<32 hex>` (the SDK's
  `_is_serverless_session_id`: its `training_session_id`, sampling route and control-plane
  name `accounts/<a>/trainingSessions/<ts>` follow from it);
- `create_model`: a LoRA model, run-scoped (`run-<32 hex>:train:<seq>`, the SDK's
  `_run_id_from_model_id`), on the Tinker face's shared LoRA resource of its base model, made
  by the Tinker face's own path (`routes.open_model`); `lora_config.rank` 0 (full parameters)
  is a 400 naming that field: the pool trains adapters only. A `base_only` reference is a
  frozen base model, not run-scoped (`<ts>:train:<seq>`), as the SDK expects;
- `create_sampling_route`: what a standalone sampler asks before it samples a checkpoint of a
  run it did not create (`{"training_run": "accounts/<a>/trainingRuns/run-<hex>"}`) or a base
  model (`{"base_model": ...}`): checked (another account's run answers as a missing one) and
  acknowledged; the completion resolves its `accounts/<a>/trainingSamplers/...` model itself.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import Field, model_validator

from trainer.api.auth import principal_of
from trainer.api.fireworks import serverless
from trainer.api.tinker import models, names
from trainer.api.tinker.records import TinkerCheckpoint
from trainer.api.tinker.requests import CreateModel
from trainer.api.tinker.routes import (
    bridge_of,
    future_json,
    get_session,
    open_model,
    parse,
    start_session,
)
from trainer.contract.base import Spec
from trainer.serving.errors import bad_request, not_found

router = APIRouter()
RUN_FIELD = "training_run"


@router.post("/create_session")
async def create_session(request: Request) -> dict[str, Any]:
    return await start_session(request, serverless.SESSION_PREFIX)


@router.post("/create_model")
async def create_model(request: Request) -> dict[str, Any]:
    body: CreateModel = await parse(request, CreateModel)
    bridge = bridge_of(request)
    who = principal_of(request)
    get_session(bridge, body.session_id, who)
    if serverless.session_of(bridge.db, who, body.session_id) is None:
        raise bad_request(
            f"session_id: {body.session_id[:80]!r} is not a serverless training session "
            f"(ts-<32 hex>: POST {serverless.PREFIX}/api/v1/create_session makes one)",
            "session_id",
        )
    if body.lora_config is not None and body.lora_config.rank == 0:
        raise bad_request(
            "lora_config.rank: 0 asks for full-parameter training; the serverless pool trains "
            "LoRA adapters only (rank >= 1; full parameters need an RLOR trainer job)",
            "lora_config.rank",
        )
    entry = bridge.entry(body.base_model)
    plan = models.plan(body, entry, None)
    seq = body.model_seq_id
    if plan.kind == "base":  # a frozen reference: not a training run
        scope, model_id = None, f"{body.session_id}:train:{seq}"
    else:
        account = names.account_of(who, None)
        scope = serverless.run_scope(account, body.session_id, seq)
        model_id = serverless.run_model_id(scope, seq)
    return future_json(open_model(bridge, body, plan, model_id, scope, who), model_id)


class SamplingRoute(Spec):
    base_model: str | None = Field(default=None, min_length=1, max_length=512)
    training_run: str | None = Field(default=None, min_length=1, max_length=512)

    @model_validator(mode="after")
    def _one(self) -> SamplingRoute:
        if (self.base_model is None) == (self.training_run is None):
            raise ValueError("send exactly one of base_model and training_run")
        return self


@router.post("/create_sampling_route")
async def create_sampling_route(request: Request) -> dict[str, Any]:
    body: SamplingRoute = await parse(request, SamplingRoute)
    bridge = bridge_of(request)
    who = principal_of(request)
    if body.base_model is not None:
        entry = bridge.entry(body.base_model)
        return {"name": f"accounts/{who.user}/trainingSamplers/{entry.name}"}
    run = body.training_run or ""
    parts = run.split("/")
    if len(parts) != 4 or parts[0] != "accounts" or parts[2] != "trainingRuns":
        raise bad_request(
            f"{RUN_FIELD}: {run[:200]!r} is not accounts/<account>/trainingRuns/run-<32 hex>",
            RUN_FIELD,
        )
    if not names.RUN_ID.fullmatch(parts[3]):
        raise bad_request(f"{RUN_FIELD}: {parts[3][:80]!r} is not run-<32 hex>", RUN_FIELD)
    account = names.account_of(who, None)
    mine = parts[1] in (who.user, account)
    rows = (
        await run_in_threadpool(
            bridge.db.select,
            TinkerCheckpoint,
            "scope IS NOT NULL AND path LIKE ?",
            (f"{account}/{parts[3]}/%",),
        )
        if mine
        else []
    )
    if not any(row.path.startswith(f"{account}/{parts[3]}/") for row in rows):
        raise not_found("training run", run, RUN_FIELD)
    return {"name": f"accounts/{who.user}/trainingSamplers/checkpoints/{account}/{parts[3]}"}
