"""A Tinker request bound to one model resource: what another face's gateway puts in its scope.

The Fireworks face (`trainer.api.fireworks`) serves each RLOR trainer job's Tinker routes under
`/training/v1/rlorTrainerJobs/{account}/{job}/api/v1/*`; its gateway checks that the caller
owns the job, rewrites the path to `/api/v1/*` and stores a `Binding` under `SCOPE_KEY` of the
ASGI scope. The Tinker routes then make their models on the job's resource (`resource_id`)
instead of the shared resource of the base model, under the job's rules: full weights or LoRA
up to the job's rank, forward-only for a frozen reference job. Checkpoint names a model saves
are scoped to the job (`scope`), so `cross_job://<job>/<name>` finds them from another job of
the same account.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SCOPE_KEY = "trainer.binding"


@dataclass(frozen=True)
class Binding:
    account: str  # the job's account: the user of the key that made it
    job_id: str
    resource_id: str  # the job's model resource (READY while the job is RUNNING)
    base_model: str  # the catalogue entry the resource loaded
    lora_rank: int  # 0: a full-weight job
    forward_only: bool  # a frozen reference: no backward, no optimizer step, no save_state

    @property
    def scope(self) -> str:
        """The namespace of the job's checkpoint names (`cross_job://<job_id>/<name>`)."""
        return f"job:{self.account}/{self.job_id}"


def binding_of(request: Any) -> Binding | None:
    """The binding a gateway stored on `request` (a starlette Request), if any."""
    value = request.scope.get(SCOPE_KEY)
    return value if isinstance(value, Binding) else None
