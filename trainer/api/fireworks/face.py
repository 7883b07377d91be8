"""Mount the Fireworks control plane (`/v1/accounts/...`) on the worker's app, beside the RL
face (`/v1/rl`) and the Tinker face (`/api/v1`), its per-job gateway
(`/training/v1/rlorTrainerJobs/...`, `gateway.JobGateway`) and its serverless surface
(`/training/v1/serverless/...`, `serverless.ServerlessGateway`); `create_app` adds both
gateways."""

from __future__ import annotations

from fastapi import Depends, FastAPI

from trainer.api.fireworks import (
    chat,
    completion_targets,
    completions,
    hotload,
    routes_catalog,
    routes_deployments,
    routes_jobs,
    serverless,
    serverless_routes,
    serverless_sessions,
)
from trainer.api.fireworks.auth import FireworksAuth
from trainer.api.fireworks.service import FireworksFace
from trainer.api.keys import KeyRing
from trainer.api.tinker.bridge import TinkerBridge
from trainer.api.tinker.face import TinkerAuth, check_tinker_ids
from trainer.serving.worker import Worker


def install(app: FastAPI, worker: Worker, keys: KeyRing, bridge: TinkerBridge) -> FireworksFace:
    face = FireworksFace(worker, keys, bridge)
    app.state.fireworks = face
    bridge.model_resolvers.append(face.catalog.resolve)  # load_adapter(accounts/<a>/models/<m>)
    auth = [Depends(FireworksAuth(keys))]
    app.include_router(routes_jobs.router, dependencies=auth)
    app.include_router(routes_catalog.router, dependencies=auth)
    # `model` of a completion: checkpoints, promoted and base models (`completion_targets`)
    completion_targets.register(face, bridge, app.state.tinker_samplers)
    app.include_router(completions.router, dependencies=auth)
    app.include_router(chat.router, dependencies=auth)
    app.include_router(routes_deployments.router, dependencies=auth)
    app.include_router(hotload.router, dependencies=auth)  # /hot_load/v1/models/hot_load
    # the serverless surface: its own Tinker routes (the rest are the Tinker face's, through
    # `serverless.ServerlessGateway`) and its training sessions on the control plane
    tinker_auth = [Depends(TinkerAuth(keys)), Depends(check_tinker_ids)]
    prefix = serverless.PREFIX + serverless.TINKER
    app.include_router(serverless_routes.router, prefix=prefix, dependencies=tinker_auth)
    app.include_router(serverless_sessions.router, dependencies=auth)
    return face
