"""Weights & Biases logging, switched on by a session's `metadata.wandb`.

    run = open_run(session_metadata, config)      # None when metadata has no `wandb`
    if run is not None:
        run.log(step, {"reward/mean": 0.4, ...})
        run.finish()

The demo calls it on the client side; the worker can call the same function with the session's
metadata to log its own operation metrics. `wandb` is imported lazily (optional extra
`pip install trainer[wandb]`). Offline mode needs no API key: `WANDB_MODE=offline` writes the
run under `<dir>/wandb/offline-run-*`, to upload later with `wandb sync`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Literal

log = logging.getLogger(__name__)


@dataclass
class Run:
    """A thin handle on a wandb run: numbers only, `/`-namespaced keys as they come."""

    handle: Any

    @property
    def url(self) -> str | None:
        url: str | None = getattr(self.handle, "url", None)
        return url

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        numbers = {
            key: float(value)
            for key, value in metrics.items()
            if isinstance(value, int | float)
            and not isinstance(value, bool)
            and math.isfinite(float(value))
        }
        self.handle.log(numbers, step=step)

    def finish(self) -> None:
        self.handle.finish()


def wandb_settings(metadata: dict[str, Any] | None) -> dict[str, Any] | None:
    """The `wandb` part of session metadata as a dict (SDK models or plain dicts), or None."""
    if not metadata:
        return None
    raw = metadata.get("wandb") if isinstance(metadata, dict) else getattr(metadata, "wandb", None)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raw = raw.model_dump(exclude_none=True)
    settings = {k: v for k, v in raw.items() if v not in (None, "")}
    return settings or None


def open_run(
    metadata: dict[str, Any] | None,
    config: dict[str, Any],
    directory: str | None = None,
    reinit: Literal["finish_previous", "create_new"] = "finish_previous",
) -> Run | None:
    """Start (or resume, by `run_id`) the run that `metadata.wandb` names; None if it names none.

    Fields used: entity, project, group, run_id, run_name (`url` is output, not input).
    """
    settings = wandb_settings(metadata)
    if settings is None:
        return None
    try:
        import wandb
    except ImportError as exc:
        raise RuntimeError(
            "metadata.wandb is set but wandb is not installed: pip install 'trainer[wandb]'"
        ) from exc
    handle = wandb.init(
        project=settings.get("project"),
        entity=settings.get("entity"),
        group=settings.get("group"),
        id=settings.get("run_id"),
        name=settings.get("run_name"),
        config=config,
        dir=directory,
        resume="allow" if settings.get("run_id") else None,
        reinit=reinit,
    )
    return Run(handle)


def worker_run(session_id: str, metadata: dict[str, Any] | None, directory: str) -> Run | None:
    """The worker's own run for a session whose metadata names one (rank 0 only).

    It logs beside the client's run, never into it (two processes cannot share a run): its id is
    the client's `run_id` + "-worker". Several sessions of one worker each get their own run.
    A W&B failure (say, online mode without an API key) switches logging off for the session
    with a warning; training goes on.
    """
    settings = wandb_settings(metadata)
    if settings is None or _rank() != 0:
        return None
    if settings.get("run_id"):
        settings["run_id"] = f"{settings['run_id']}-worker"
    settings["run_name"] = f"{settings.get('run_name') or session_id} (worker)"
    try:
        return open_run(
            {"wandb": settings}, {"session_id": session_id}, directory, reinit="create_new"
        )
    except Exception as exc:  # wandb raises many types (usage, network, auth): all mean "off"
        log.warning("W&B logging is off for session %s: %s", session_id, exc)
        return None


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
