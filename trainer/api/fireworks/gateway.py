"""The per-job gateway: `/training/v1/rlorTrainerJobs/{account}/{job}/api/v1/*` is the Tinker
face bound to that job (`trainer.api.tinker.binding`).

A pure ASGI middleware, outside the body limit and the audit trail so both see the rewritten
request: it authenticates the key (`X-Api-Key` or bearer), checks that the job is the caller's
(another account's job, or a missing one: the same 404) and RUNNING (else a 400
`failed_precondition` naming its state: the SDK's healthz probe is 200 only while RUNNING, and
a 4xx is never retried as a 5xx is), rewrites the path to `/api/v1/*` and stores the job's
`Binding` under `SCOPE_KEY`. The Tinker routes then check the key again as they always do.
"""

from __future__ import annotations

from typing import Any

from fastapi.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from trainer.api.fireworks.auth import FireworksAuth
from trainer.api.fireworks.jobs import RUNNING, missing_job
from trainer.api.tinker.binding import SCOPE_KEY
from trainer.serving.errors import ApiError, failed_precondition

PREFIX = "/training/v1/rlorTrainerJobs/"
TINKER = "/api/v1"


class JobGateway:
    def __init__(self, app: ASGIApp, fastapi_app: Any) -> None:
        self.app = app
        self.fastapi_app = fastapi_app  # its `state.fireworks` is installed after this

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PREFIX):
            await self.app(scope, receive, send)
            return
        try:
            scope = await self._bound(scope)
        except ApiError as exc:
            await exc.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    async def _bound(self, scope: Scope) -> Scope:
        account, _, rest = scope["path"][len(PREFIX) :].partition("/")
        job_id, _, tail = rest.partition("/")
        tail = "/" + tail
        if not account or not job_id or not (tail == TINKER or tail.startswith(TINKER + "/")):
            raise ApiError(
                404,
                f"route: {scope['path'][:200]!r} is not a trainer job's Tinker route "
                f"({PREFIX}<account>/<job>{TINKER}/...)",
                param="route",
                code="not_found",
            )
        face = self.fastapi_app.state.fireworks
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        who = FireworksAuth(face.keys).principal(headers)
        if account != who.user:
            raise missing_job(job_id)
        job = await run_in_threadpool(face.jobs.find, who, job_id)
        if job.state != RUNNING or job.resource_id is None:
            raise failed_precondition(
                f"{job.id}: RLOR trainer job is {job.state}; its Tinker routes answer while it "
                "is JOB_STATE_RUNNING (POST :resume a paused, failed or cancelled job)",
                "rlorTrainerJobId",
            )
        bound = dict(scope)
        bound["path"] = tail
        bound["raw_path"] = tail.encode()
        bound[SCOPE_KEY] = face.jobs.binding(job)
        return bound
