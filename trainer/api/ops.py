"""Per-session FIFO execution of operations, recorded in the worker's catalogue.

Each live session owns one worker thread and one queue: its operations run one at a time, in
arrival order, while other sessions of the same resource run theirs in their own threads (the
engine makes each call atomic and thread-safe across sessions). An operation moves PENDING ->
RUNNING -> COMPLETED | FAILED; expected failures (`OperationError`) keep their code, anything
else becomes INTERNAL_ERROR and is logged with its traceback.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from trainer.api.store import (
    OP_COMPLETED,
    OP_FAILED,
    OP_PENDING,
    OP_RUNNING,
    OperationRow,
    WorkerStore,
)
from trainer.errors import OperationError

log = logging.getLogger(__name__)

ERROR_PREFIX = "TRAINING_OPERATION_ERROR_CODE_"
Call = Callable[[], dict[str, Any]]


def op_error(code: str, message: str) -> dict[str, str]:
    return {"code": f"{ERROR_PREFIX}{code}", "message": message}


@dataclass
class Job:
    op_id: str
    kind: str
    call: Call
    done: Future[None] = field(default_factory=Future)


class SessionQueue:
    """One thread running one session's jobs in order.

    `finish` runs the job and records its outcome; `on_idle` is called after each job (activity
    and session-state bookkeeping); `on_closed` runs once, in the thread, after `close()`.
    """

    def __init__(
        self,
        session_id: str,
        finish: Callable[[Job], None],
        on_closed: Callable[[], None],
    ) -> None:
        self.session_id = session_id
        self._finish = finish
        self._on_closed = on_closed
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._pending: list[Job] = []
        self.running: Job | None = None
        self.closed = False
        self._thread = threading.Thread(target=self._loop, name=f"ops-{session_id}", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        with self._lock:
            return self.running is not None or bool(self._pending)

    def submit(self, job: Job) -> bool:
        """Queue `job`; False if the queue is closed (the session is stopping)."""
        with self._lock:
            if self.closed:
                return False
            self._pending.append(job)
        self._queue.put(job)
        return True

    def close(self) -> list[Job]:
        """Stop accepting jobs; return the queued ones (not started) for the caller to fail."""
        with self._lock:
            if self.closed:
                return []
            self.closed = True
            cancelled, self._pending = self._pending, []
        self._queue.put(None)
        return cancelled

    def join(self, timeout: float | None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                break
            with self._lock:
                if job not in self._pending:  # cancelled by close()
                    continue
                self._pending.remove(job)
                self.running = job
            try:
                self._finish(job)
            except Exception:  # e.g. the catalogue's disk is full: keep serving the session
                log.exception("session %s: recording op %s failed", self.session_id, job.op_id)
            finally:
                with self._lock:
                    self.running = None
                job.done.set_result(None)
        self._on_closed()


class OperationLog:
    """Records operations and runs a job's call with the outcome mapped to wire statuses."""

    def __init__(self, store: WorkerStore) -> None:
        self.store = store
        self.futures: dict[str, Future[None]] = {}
        self.closed = False

    def create(self, session_id: str, kind: str, key: str, body_hash: str) -> OperationRow:
        now = time.time()
        row = OperationRow(
            id=f"op_{uuid.uuid4().hex}",
            session_id=session_id,
            kind=kind,
            idem_key=key,
            body_hash=body_hash,
            status=OP_PENDING,
            created_at=now,
            updated_at=now,
        )
        self.store.insert(row)
        return row

    def fail(self, op_id: str, code: str, message: str) -> None:
        if not self.closed:
            self.store.update(OperationRow, op_id, status=OP_FAILED, error=op_error(code, message))

    def run(self, job: Job, postprocess: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        if self.closed:
            return
        self.store.update(OperationRow, job.op_id, status=OP_RUNNING)
        started = time.perf_counter()
        try:
            output = postprocess(job.call())
        except OperationError as exc:
            log.info("op %s %s failed: %s %s", job.kind, job.op_id, exc.code, exc.message)
            self.fail(job.op_id, exc.code, exc.message)
            return
        except Exception as exc:  # the engine's bugs become data, not a dead worker thread
            log.exception("op %s %s crashed", job.kind, job.op_id)
            self.fail(job.op_id, "INTERNAL_ERROR", f"internal error: {type(exc).__name__}: {exc}")
            return
        if not self.closed:
            self.store.update(OperationRow, job.op_id, status=OP_COMPLETED, output=output)
        log.info("op %s %s done in %.3fs", job.kind, job.op_id, time.perf_counter() - started)
