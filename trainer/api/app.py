"""The FastAPI application: routers under `/v1`, auth, error bodies, lifespan.

Three faces: the RL session API (`/v1/rl`), the Tinker API (`/api/v1`) and the Fireworks
control plane (`/v1/accounts/...`, with each trainer job's Tinker routes under
`/training/v1/rlorTrainerJobs/{account}/{job}/api/v1`, and the serverless surface under
`/training/v1/serverless`). `/v1/rl/...` routes need the bearer
token; the signed file/payload routes carry their own credential in the query string;
`/healthz` is open for liveness probes. `/v1/rl/audit` and `/metrics` answer admin keys only
(`trainer.api.audit`, `trainer.api.metrics`); every mutating call is a line of the audit trail
(`AuditMiddleware`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from trainer.api import audit
from trainer.api import metrics as metrics_routes
from trainer.api.audit import AuditMiddleware
from trainer.api.auth import BearerAuth
from trainer.api.fireworks.face import install as install_fireworks
from trainer.api.fireworks.gateway import JobGateway
from trainer.api.fireworks.serverless import ServerlessGateway
from trainer.api.keys import KeyRing
from trainer.api.metrics import Metrics
from trainer.api.rl import routes_metrics, routes_ops, routes_resources, routes_sessions
from trainer.api.signing import UrlSigner
from trainer.api.tinker.bridge import TinkerBridge
from trainer.api.tinker.face import install as install_tinker
from trainer.serving.audit_log import AuditLog
from trainer.serving.errors import ApiError, install_handlers
from trainer.serving.ids import check_path_ids
from trainer.serving.worker import Worker

log = logging.getLogger(__name__)


class DoubleVersionPrefix:
    """Accept `/v1/v1/rl/...` as `/v1/rl/...`.

    SDK 3.1.1's paths already start with `/v1` (its default base URL has none), so a client
    built as `Together(base_url="http://HOST:PORT/v1")` requests `/v1/v1/rl/...`. Both
    spellings of the base URL work.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/v1/"):
            scope = dict(scope)
            scope["path"] = scope["path"][3:]
            scope["raw_path"] = scope["path"].encode()
        await self.app(scope, receive, send)


CONTROL_BODY_MAX = 1 << 20
# Tinker POSTs that carry data, streamed under `max_body_bytes` by their routes
STREAMED_POSTS = (
    "/api/v1/forward",
    "/api/v1/forward_backward",
    "/api/v1/asample",
    "/api/v1/optim_step",
    "/inference/v1/completions",  # trainer/api/fireworks/completions.py reads its own body
    "/v1/completions",
    "/inference/v1/chat/completions",  # trainer/api/fireworks/chat.py too
    "/v1/chat/completions",
)


class ControlBodyLimit:
    """Cap the bodies that FastAPI decodes itself at 1 MiB (413), as they arrive.

    The typed-body POSTs (create resource or session, estimate cost, extend expiry, stop) have
    their body read in full before the token is checked and decoded on the event loop, so an
    unbounded body there would be memory and a stall for anyone who can connect. They carry a
    few fields: the middleware reads at most `limit` bytes and replays them to the route.
    Operation POSTs, PATCH and payload PUTs stream under their own caps (`max_body_bytes`,
    `max_payload_bytes`) and pass straight through.
    """

    def __init__(self, app: ASGIApp, limit: int = CONTROL_BODY_MAX) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] != "POST"
            or "/operations/" in scope["path"]
            or scope["path"] in STREAMED_POSTS
        ):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length", b"").decode("latin-1").strip()
        if declared.isdigit() and (len(declared) > 18 or int(declared) > self.limit):
            await self._refuse(scope, receive, send)
            return
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.limit:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = ApiError(
            413,
            f"request body exceeds {self.limit} bytes (this route takes a few fields)",
            param="body",
            code="request_too_large",
        )
        await error.response()(scope, receive, send)


async def _sweep_forever(worker: Worker, tinker: TinkerBridge) -> None:
    """Stop resources idle past their `expires_at`, and Tinker sessions whose heartbeats
    stopped (checked every `expiry_check_s`)."""
    while True:
        await asyncio.sleep(worker.config.expiry_check_s)
        await run_in_threadpool(worker.sweep, time.time())
        await run_in_threadpool(tinker.sweep, time.time())


def _drain(worker: Worker, tinker: TinkerBridge) -> None:
    """Shut down within `shutdown_grace_s`: the Tinker face first, while the engine still
    serves its running requests (its queued ones fail cleanly), then the worker's operations,
    then the Tinker records, once no dispatcher writes them."""
    grace = worker.config.shutdown_grace_s
    started = time.monotonic()
    log.info("shutting down: draining operations (grace %.0fs)", grace)
    try:
        if not tinker.drain(grace):
            log.warning("shutting down: Tinker requests still run after the grace")
        worker.shutdown(max(0.0, grace - (time.monotonic() - started)))
    finally:
        tinker.close()


def create_app(worker: Worker, token: str | None, keys: KeyRing | None = None) -> FastAPI:
    """The worker's HTTP app. `keys` (a keys file's users) wins over the single `token` (one
    user, `local`, an admin); neither serves without auth (the CLI allows that on loopback
    hosts only)."""
    ring = keys if keys is not None else KeyRing(token=token)

    metrics = Metrics(worker)
    config = worker.config

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if config.metrics_port:
            port = metrics.serve_port(config.metrics_host, config.metrics_port)
            log.info("metrics without a key on http://%s:%d/metrics", config.metrics_host, port)
        sweeper = asyncio.create_task(_sweep_forever(worker, tinker))
        try:
            yield
        finally:
            sweeper.cancel()
            await run_in_threadpool(_drain, worker, tinker)
            fireworks.close()
            metrics.close()

    # No open /openapi.json or /docs: the schema is served at /v1/openapi.json behind the token.
    app = FastAPI(
        title="trainer worker",
        version="1",
        lifespan=lifespan,
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )
    app.state.worker = worker
    app.state.signer = UrlSigner.for_storage(worker.config.storage, worker.config.signed_url_ttl_s)
    install_handlers(app)
    app.state.metrics = metrics
    app.state.audit = AuditLog(config.storage, config.audit_max_bytes, config.audit_keep)
    app.add_middleware(AuditMiddleware, log=app.state.audit, fastapi_app=app)  # innermost
    app.add_middleware(ControlBodyLimit)
    app.add_middleware(JobGateway, fastapi_app=app)  # a job's Tinker routes: /api/v1 bound
    app.add_middleware(ServerlessGateway)  # /training/v1/serverless/...: Tinker, completions
    app.add_middleware(DoubleVersionPrefix)
    app.state.keys = ring
    worker.principals = ring.principal  # the quotas of each operation's owner
    auth = [Depends(BearerAuth(ring)), Depends(check_path_ids)]
    for module in (routes_resources, routes_sessions, routes_ops, routes_metrics):
        app.include_router(module.router, prefix="/v1", dependencies=auth)
    files = [Depends(check_path_ids)]
    app.include_router(routes_resources.files_router, dependencies=files)
    app.include_router(routes_sessions.files_router, dependencies=files)

    tinker = install_tinker(app, worker, ring)
    fireworks = install_fireworks(app, worker, ring, tinker)  # /v1/accounts/...
    app.include_router(audit.router)  # admin keys only: both answer 404 to anyone else
    app.include_router(metrics_routes.router)

    @app.get("/v1/openapi.json", include_in_schema=False, dependencies=auth)
    async def openapi() -> dict[str, Any]:
        return app.openapi()

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        health: dict[str, Any] = {"status": "draining" if worker.draining else "ok"}
        replicas = worker.generator_health()
        if replicas:  # vLLM generator replicas by state: {"healthy": 2, "restarting": 1}
            health["generator_replicas"] = replicas
        return health

    return app
