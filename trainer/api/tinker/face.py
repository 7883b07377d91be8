"""Mount the Tinker API under `/api/v1` of the worker's app: the auth, the routers, and a
clear answer for every route the SDK knows that this worker does not serve."""

from __future__ import annotations

from fastapi import APIRouter, Depends, FastAPI, Request

from trainer.api.auth import ApiKeyAuth
from trainer.api.keys import KeyRing, Principal
from trainer.api.tinker import (
    paths,
    routes,
    routes_firetitan,
    routes_publish,
    routes_runs,
    routes_train,
    sampling,
)
from trainer.api.tinker.bridge import TinkerBridge
from trainer.api.tinker.paths import TINKER_ID
from trainer.serving.errors import ApiError, bad_request
from trainer.serving.worker import Worker

PREFIX = "/api/v1"
KEY_PREFIX = "tml-"
# Routes of the tinker SDK this worker does not serve: a 400 naming the route, not a bare 404.
# Not 501: the SDK's `execute_with_retries` retries every 5xx for five minutes (whatever
# `x-should-retry` says), so a 501 would hang the client; a 4xx fails its call at once.
NOT_SERVED_STATUS = 400
NOT_SERVED = {
    "auth/token": "credentials are the worker's token; no token exchange",
    "create_custom_loss": "custom losses run client-side (custom_loss_server_side false)",
    "join_sampling_session": "sample_join_sampling_session is false in client/config",
    "cancel_future": "sample_cancel_enabled is false in client/dynamic_config",
    "audit": "no audit log",
    "billing": "no billing",
    "whoami": (
        "the SDK reads whoami from a JWT of its auth exchange, which this worker does not "
        "serve; the key names its user (created_by, model_owner)"
    ),
    "sessions/search": "list sessions with GET /api/v1/sessions",
}
SESSION_NOT_SERVED = ("/project", "/trace_export")


class TinkerAuth(ApiKeyAuth):
    """The key as the SDK sends it: `X-API-Key`, or a bearer token. The SDK refuses keys
    without its `tml-` prefix, so `tml-<key>` names the same key as `<key>`."""

    missing = "missing API key: send X-API-Key (TINKER_API_KEY)"

    def lookup(self, given: str) -> Principal | None:
        principal = self.keys.identify(given)
        if principal is None and given.startswith(KEY_PREFIX):
            principal = self.keys.identify(given.removeprefix(KEY_PREFIX))
        return principal


async def check_tinker_ids(request: Request) -> None:
    """Refuse (400 naming it) a path parameter outside the Tinker id alphabet; a checkpoint id
    is `<weights|sampler_weights|external_weights>/<name>`, each part a safe id."""
    for name, value in request.path_params.items():
        if name == "route":
            continue
        parts = value.split("/") if name == "checkpoint_id" else [value]
        good = len(parts) == (2 if name == "checkpoint_id" else 1) and all(
            isinstance(p, str) and TINKER_ID.fullmatch(p) for p in parts
        )
        if not good:
            raise bad_request(
                f"{name}: {value[:200]!r} is not a valid id (letters, digits, '_', '-', ':'; "
                "a checkpoint id is <weights|sampler_weights|external_weights>/<name>)",
                name,
                "invalid_id",
            )


fallback = APIRouter()
ROUTE_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]


@fallback.api_route("", methods=ROUTE_METHODS, include_in_schema=False)
@fallback.api_route("/", methods=ROUTE_METHODS, include_in_schema=False)
async def no_route() -> None:
    raise ApiError(
        404,
        f"route: {PREFIX} alone names no route of the Tinker API",
        code="not_found",
        param="route",
    )


@fallback.api_route("/{route:path}", methods=ROUTE_METHODS, include_in_schema=False)
async def not_served(route: str) -> None:
    for known, why in NOT_SERVED.items():
        if route == known or route.startswith(f"{known}/"):
            raise ApiError(
                NOT_SERVED_STATUS,
                f"route {PREFIX}/{route}: not served by this worker ({why})",
                code="not_implemented",
                param="route",
            )
    if route.startswith("sessions/") and route.endswith(SESSION_NOT_SERVED):
        raise ApiError(
            NOT_SERVED_STATUS,
            f"route {PREFIX}/{route}: not served (sessions have no projects or traces)",
            code="not_implemented",
            param="route",
        )
    raise ApiError(
        404,
        f"route {PREFIX}/{route}: no such route in the Tinker API this worker serves",
        code="not_found",
        param="route",
    )


def install(app: FastAPI, worker: Worker, keys: KeyRing) -> TinkerBridge:
    bridge = TinkerBridge(worker)
    app.state.tinker = bridge
    app.state.tinker_samplers = sampling.SamplerSessions(bridge)
    # a published checkpoint is every user's to read, on either face (`routes_publish`)
    worker.checkpoint_shared = lambda record: paths.shares(bridge, record)
    auth = [Depends(TinkerAuth(keys)), Depends(check_tinker_ids)]
    # routes_publish before routes_runs, whose `{checkpoint_id:path}` would take `.../publish`
    for module in (routes, routes_train, routes_firetitan, sampling, routes_publish, routes_runs):
        app.include_router(module.router, prefix=PREFIX, dependencies=auth)
    app.include_router(fallback, prefix=PREFIX, dependencies=auth)
    return bridge
