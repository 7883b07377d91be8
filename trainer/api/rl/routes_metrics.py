"""`GET /v1/rl/worker-metrics`: the schedulers' counters of the live resources
(`batching/pass_scheduler.py`).

`passes`: calls or groups of calls the combiner ran (a pass of one is a solo call);
`merged_passes`: passes that held more than one session's call; `merged_items`: the calls that
ran in those; `max_sessions_per_pass`: the most sessions one pass held; `sample_batches` and
`batched_samples`: generations that held more than one session's sample, and those samples
(`sample_batch.py`). Totals over the live resources, and each one's own under `per_resource`
(keyed by resource id).

Per user: a key sees the resources it owns (its own activity), an admin every live resource.
Another user's resource, shared or not, is not listed and counts in no total: its ids and
counters are that user's (`trainer.serving.ownership`).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from trainer.api.auth import principal_of
from trainer.api.http import worker_of
from trainer.serving.catalogue import ResourceRow
from trainer.serving.ownership import visible

router = APIRouter()

SUMMED = ("passes", "merged_passes", "merged_items", "sample_batches", "batched_samples")


@router.get("/rl/worker-metrics", include_in_schema=False)  # not a contract endpoint
async def worker_metrics(request: Request) -> dict[str, Any]:
    worker = worker_of(request)
    who = principal_of(request)
    resources = worker.resources
    with resources.lock:
        live = list(resources.live.values())
    per_resource: dict[str, dict[str, int]] = {}
    for resource in live:
        row = worker.store.get(ResourceRow, resource.id)
        mine = row is not None and visible(who, row.owner)  # not `shared`: others' activity
        if resource.engine is not None and mine:
            per_resource[resource.id] = resource.engine.counters()
    totals: dict[str, Any] = {key: sum(c[key] for c in per_resource.values()) for key in SUMMED}
    totals["max_sessions_per_pass"] = max(
        (c["max_sessions_per_pass"] for c in per_resource.values()), default=0
    )
    return {**totals, "per_resource": per_resource}
