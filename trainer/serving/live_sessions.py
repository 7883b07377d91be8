"""The sessions a worker has open in the engine, each with its FIFO queue (`SessionQueue`).

A recorded session is opened from a thread (`LiveSessions.open`: RUNNING, or ERROR with the
engine's reason), runs its jobs one at a time (`_finish` writes its step and policy back after
each), and is closed by `close`: queued jobs fail, the running one gets a grace period, and
the engine's slot is released once the queue is idle (`_closed`: STOPPED, EXPIRED or ERROR).

`Worker` (`trainer.serving.worker`) decides what may open or run; this table holds the live
state, under one lock that the worker shares.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from trainer.contract.errors import OperationError
from trainer.contract.specs import SessionSpec
from trainer.serving.catalogue import (
    OP_FAILED,
    SES_ERROR,
    SES_RUNNING,
    SES_STOPPED,
    SES_STOPPING,
    Catalogue,
    OperationRow,
    SessionRow,
)
from trainer.serving.config import ServeConfig
from trainer.serving.engine_protocols import EngineResource, EngineSession
from trainer.serving.lifecycle import ResourceManager
from trainer.serving.ownership import owned
from trainer.serving.payloads import PayloadFiles, offload_result
from trainer.serving.queues import Job, OperationLog, SessionQueue, op_error
from trainer.serving.session_open import effective_lora, failed, refused
from trainer.serving.tenants import Principal

log = logging.getLogger(__name__)


@dataclass
class LiveSession:
    id: str
    resource_id: str
    engine: EngineSession
    queue: SessionQueue
    final_status: str = SES_STOPPED


def session_row(store: Catalogue, session_id: str, who: Principal | None = None) -> SessionRow:
    """The session's row; with `who`, only one `who` sees (another's: the same 404)."""
    return owned(
        store.get(SessionRow, session_id),
        who,
        "training session",
        session_id,
        "session_id",
    )


@dataclass(eq=False)
class LiveSessions:
    """The open sessions by id (`table`), under `lock`: the `Worker` shares both."""

    config: ServeConfig  # its `result_offload_bytes`, read as each job finishes
    store: Catalogue
    oplog: OperationLog
    payloads: PayloadFiles
    resources: ResourceManager
    table: dict[str, LiveSession] = field(default_factory=dict)
    lock: threading.RLock = field(default_factory=threading.RLock)
    draining: bool = False  # shutting down: a session that opens now closes at once
    stop_requested: set[str] = field(default_factory=set)  # stopped while still CREATING

    def get(self, session_id: str) -> LiveSession | None:
        with self.lock:
            return self.table.get(session_id)

    def busy(self, resource_id: str) -> bool:
        with self.lock:
            return any(s.queue.busy for s in self.table.values() if s.resource_id == resource_id)

    def open(
        self,
        session_id: str,
        resource_id: str,
        engine: EngineResource,
        spec: SessionSpec,
        future: Future[SessionRow],
    ) -> None:
        try:
            session = engine.create_session(session_id, spec)
        except OperationError as exc:
            self.store.update(SessionRow, session_id, status=SES_ERROR, error=refused(exc))
            future.set_exception(exc)
            return
        except Exception as exc:  # an engine bug must not leave the session CREATING forever
            log.exception("session %s: opening failed", session_id)
            error = failed("opening", exc)
            self.store.update(SessionRow, session_id, status=SES_ERROR, error=error)
            future.set_result(session_row(self.store, session_id))
            return
        queue = SessionQueue(
            session_id,
            finish=lambda job: self._finish(session_id, job),
            on_closed=lambda: self._closed(session_id),
        )
        with self.lock:
            self.table[session_id] = LiveSession(session_id, resource_id, session, queue)
        self.store.update(
            SessionRow,
            session_id,
            status=SES_RUNNING,
            step=int(session.step),
            policy_state=dict(session.policy_state()),
            lora_config=effective_lora(session, session_row(self.store, session_id).lora_config),
        )
        log.info("session %s running on %s", session_id, resource_id)
        live_res = self.resources.get_live(resource_id)
        stop = session_id in self.stop_requested
        if stop or live_res is None or live_res.stopped or self.draining:
            self.close([session_row(self.store, session_id)], SES_STOPPED, 5.0)
        future.set_result(session_row(self.store, session_id))

    def close(self, rows: list[SessionRow], final: str, wait_s: float) -> None:
        """Cancel queued operations, let running ones finish (up to `wait_s`), then close."""
        closing: list[LiveSession] = []
        for row in rows:
            with self.lock:
                live = self.table.get(row.id)
            if live is None:  # still CREATING: `open` closes it once open
                self.stop_requested.add(row.id)
                self.store.update(SessionRow, row.id, status=SES_STOPPING)
                continue
            live.final_status = final
            self.store.update(SessionRow, row.id, status=SES_STOPPING)
            for job in live.queue.close():
                self.oplog.fail(job.op_id, "SESSION_NOT_ACTIVE", "the session stopped first")
                job.done.set_result(None)
            closing.append(live)
        deadline = time.monotonic() + wait_s
        for live in closing:
            live.queue.join(max(0.0, deadline - time.monotonic()))

    def abandon(self, lives: list[LiveSession]) -> list[str]:
        """At shutdown, once the grace period is over: each op still running is recorded
        FAILED (a late finish records nothing more), its session STOPPED. Returns their ids."""
        abandoned = []
        for live in lives:
            running = live.queue.running
            if running is not None:
                log.warning("abandoning op %s %s at shutdown", running.kind, running.op_id)
                abandoned.append(running.op_id)
                error = op_error("SESSION_NOT_ACTIVE", "the worker shut down while it ran")
                self.store.update(OperationRow, running.op_id, status=OP_FAILED, error=error)
                self.store.update(SessionRow, live.id, status=SES_STOPPED)
        return abandoned

    def _closed(self, session_id: str) -> None:
        """Runs in the session's queue thread once its last job is done."""
        with self.lock:
            live = self.table.pop(session_id, None)
        if live is None or self.oplog.closed:
            return
        live_res = self.resources.get_live(live.resource_id)
        status, error = live.final_status, None
        if live_res is not None and live_res.engine is not None:
            try:
                live_res.engine.close_session(session_id)
            except Exception as exc:  # report it on the session; the slot state is unknown
                log.exception("session %s: closing failed", session_id)
                status, error = SES_ERROR, failed("closing", exc)
        self.store.update(SessionRow, session_id, status=status, error=error)
        self.payloads.drop_session(session_id)
        log.info("session %s %s", session_id, status)

    def _finish(self, session_id: str, job: Job) -> None:
        """Runs in the session's queue thread: the job, then the session's bookkeeping."""
        limit = self.config.result_offload_bytes
        self.oplog.run(job, lambda out: offload_result(self.payloads, session_id, out, limit))
        self.oplog.futures.pop(job.op_id, None)
        with self.lock:
            live = self.table.get(session_id)
        if live is None or self.oplog.closed:
            return
        self.store.update(
            SessionRow,
            session_id,
            step=int(live.engine.step),
            policy_state=dict(live.engine.policy_state()),
        )
        self.resources.touch(live.resource_id)

    def policy(self, session_id: str) -> tuple[int, dict[str, Any]] | None:
        """A live session's step and policy state (None: not live)."""
        live = self.get(session_id)
        if live is None:
            return None
        return int(live.engine.step), dict(live.engine.policy_state())
