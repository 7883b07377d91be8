"""The Fireworks serverless surface: `FiretitanServiceClient(base_url=".../training/v1/serverless")`
(docs/semantics.md §26).

A thin face over the Tinker face and the completions route. `ServerlessGateway`, a pure ASGI
middleware beside the job gateway, maps the prefix `/training/v1/serverless`:
- `/api/v1/create_session`, `/api/v1/create_model` and `/api/v1/create_sampling_route` stay
  where they are: the serverless routes (`serverless_routes`) mint `ts-` sessions and
  run-scoped models (`run-<32 hex>:train:<seq>`) and check a standalone sampler's route;
- every other `/api/v1/*` becomes the Tinker face's own route (forward_backward, optim_step,
  saves, loads, futures, heartbeats): the Tinker routes check the key and the owner as always;
- `/inference/v1/completions` becomes the completions route, whose `model` names a training
  session (`accounts/<a>/trainingSessions/<ts>[/checkpoints/<c>]`) or a standalone sampler
  (`accounts/<a>/trainingSamplers/...`), resolved in `completion_targets`.

A run-scoped model's checkpoint names live in the name space `run_scope(account, ts, seq)`, so
its sampler paths are `<account>/run-<32 hex>/<name>` with the very run id its model id starts
with (`trainer.api.tinker.names`), which is how the SDK tells a checkpoint of its own run.
"""

from __future__ import annotations

import re

from starlette.types import ASGIApp, Receive, Scope, Send

from trainer.api.tinker import names
from trainer.api.tinker.records import TinkerRecords, TinkerSession
from trainer.serving.errors import ApiError
from trainer.serving.tenants import Principal

PREFIX = "/training/v1/serverless"
TINKER = "/api/v1"
OWN = frozenset(
    f"{TINKER}/{name}" for name in ("create_session", "create_model", "create_sampling_route")
)
COMPLETIONS = "/inference/v1/completions"
SESSION_PREFIX = "ts-"
SESSION_ID = re.compile(r"^ts-[0-9a-f]{32}$")
SCOPE_PREFIX = "serverless:"


def is_session_id(value: str) -> bool:
    """A serverless training session's id (`ts-<32 hex>`), as this worker mints them."""
    return bool(SESSION_ID.fullmatch(value))


def session_of(db: TinkerRecords, who: Principal, session_id: str) -> TinkerSession | None:
    """The one ownership check of the surface: `session_id` when it is a serverless session of
    `who`'s own account (a Fireworks key has one account, admins included), else None, which
    every caller answers as a missing session."""
    found = db.get(TinkerSession, session_id) if is_session_id(session_id) else None
    return found if found is not None and found.owner == who.user else None


def session_scope(account: str, session_id: str) -> str:
    """The prefix of the name spaces of a session's run-scoped models."""
    return f"{SCOPE_PREFIX}{account}/{session_id}/"


def run_scope(account: str, session_id: str, seq: int) -> str:
    """The name space of model `seq` of a serverless session (`names.scope_of`)."""
    return f"{session_scope(account, session_id)}{seq}"


def run_model_id(scope: str, seq: int) -> str:
    """`run-<32 hex>:train:<seq>`: the run id is the name space's (`names.run_id`)."""
    return f"{names.run_id(scope)}:train:{seq}"


def not_a_route(path: str) -> ApiError:
    return ApiError(
        404,
        f"route: {path[:200]!r} is not a route of the serverless surface ({PREFIX}{TINKER}/... "
        f"or {PREFIX}{COMPLETIONS})",
        param="route",
        code="not_found",
    )


class ServerlessGateway:
    """Rewrite `/training/v1/serverless/...` onto the routes that serve it (module doc)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not (path == PREFIX or path.startswith(PREFIX + "/")):
            await self.app(scope, receive, send)
            return
        tail = path[len(PREFIX) :]
        if tail in OWN:
            await self.app(scope, receive, send)
            return
        if not (tail in (COMPLETIONS, TINKER) or tail.startswith(TINKER + "/")):
            await not_a_route(path).response()(scope, receive, send)
            return
        bound = dict(scope)
        bound["path"] = tail
        bound["raw_path"] = tail.encode()
        await self.app(bound, receive, send)
