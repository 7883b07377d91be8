"""Per-session FIFO execution of operations, recorded in the worker's catalogue.

Each live session has one queue: its operations run one at a time, in arrival order, while other
sessions of the same resource run theirs in their own threads (the engine makes each call atomic
and thread-safe across sessions). A queue holds a thread only while it has work: one starts when
a job arrives at an idle queue and ends when the queue is empty, so idle sessions cost no thread.
An operation moves PENDING -> RUNNING -> COMPLETED | FAILED; expected failures (`OperationError`)
keep their code, anything else becomes INTERNAL_ERROR and is logged with its traceback. What
an operation runs is an `EngineCall` on its session (a `CountedCall` also carries the tokens it
trains on, for the metrics).

A status the catalogue cannot take (its disk is full) is kept in memory and served from there,
so a client polling an operation still sees it finish; it is written once space is freed
(`OperationLog.flush`, run by the worker's periodic sweep).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

from trainer.contract.errors import OperationError
from trainer.serving.catalogue import (
    OP_COMPLETED,
    OP_FAILED,
    OP_PENDING,
    OP_RUNNING,
    Catalogue,
    OperationRow,
)
from trainer.serving.engine_protocols import EngineSession
from trainer.serving.errors import is_disk_full
from trainer.serving.users import LOCAL_USER

log = logging.getLogger(__name__)

ERROR_PREFIX = "TRAINING_OPERATION_ERROR_CODE_"
Call = Callable[[], dict[str, Any]]
EngineCall = Callable[[EngineSession], dict[str, Any]]


@dataclass(frozen=True)
class CountedCall:
    """An engine call with the tokens it trains on, for the metrics (`Operation.call`)."""

    run: EngineCall
    trained_tokens: int = 0

    def __call__(self, session: EngineSession) -> dict[str, Any]:
        return self.run(session)


def op_error(code: str, message: str) -> dict[str, str]:
    return {"code": f"{ERROR_PREFIX}{code}", "message": message}


@dataclass
class Job:
    op_id: str
    kind: str
    call: Call
    done: Future[None] = field(default_factory=Future)
    user: str = LOCAL_USER  # whose request queued it (`trainer.serving.users`)
    trained_tokens: int = 0  # the tokens it trains on (a forward-backward's samples)


# Called once an operation that ran has its outcome recorded: (job, "completed" | "failed",
# seconds it ran, its output before any offload, or None when it failed).
Listener = Callable[[Job, str, float, dict[str, Any] | None], None]


class SessionQueue:
    """One session's jobs, run in order by a thread that lives only while there is work.

    `finish` runs the job and records its outcome; `on_closed` runs once, in a queue thread,
    after `close()` and after the running job (if any) is done.
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
        self._lock = threading.Lock()
        self._pending: deque[Job] = deque()
        self._thread: threading.Thread | None = None  # the one draining the queue, if any
        self._finished = threading.Event()  # on_closed has run
        self.running: Job | None = None
        self.closed = False

    @property
    def busy(self) -> bool:
        with self._lock:
            return self.running is not None or bool(self._pending)

    @property
    def depth(self) -> int:
        """Operations queued or running."""
        with self._lock:
            return len(self._pending) + (self.running is not None)

    def submit(self, job: Job) -> bool:
        """Queue `job`; False if the queue is closed (the session is stopping)."""
        with self._lock:
            if self.closed:
                return False
            self._pending.append(job)
            self._start_thread()
        return True

    def close(self) -> list[Job]:
        """Stop accepting jobs; return the queued ones (not started) for the caller to fail."""
        with self._lock:
            if self.closed:
                return []
            self.closed = True
            cancelled = list(self._pending)
            self._pending.clear()
            self._start_thread()  # an idle queue still needs a thread to run on_closed
        return cancelled

    def join(self, timeout: float | None) -> bool:
        """Wait until the queue is closed and drained (`on_closed` has run)."""
        return self._finished.wait(timeout)

    def _start_thread(self) -> None:
        """With `_lock` held: start a draining thread unless one is running."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._drain, name=f"ops-{self.session_id}", daemon=True
            )
            self._thread.start()

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    if not self.closed:
                        self._thread = None  # idle: the next submit starts a new thread
                        return
                    break  # closed and drained: run on_closed
                job = self._pending.popleft()
                self.running = job
            try:
                self._finish(job)
            except Exception:  # e.g. the catalogue's disk is full: keep serving the session
                log.exception("session %s: recording op %s failed", self.session_id, job.op_id)
            finally:
                with self._lock:
                    self.running = None
                job.done.set_result(None)
        try:
            self._on_closed()
        finally:
            self._finished.set()


class OperationLog:
    """Records operations and runs a job's call with the outcome mapped to wire statuses."""

    def __init__(self, store: Catalogue) -> None:
        self.store = store
        self.futures: dict[str, Future[None]] = {}
        self.closed = False
        self._unrecorded: dict[str, dict[str, Any]] = {}  # op id -> changes not yet written
        self._lock = threading.Lock()
        self.listeners: list[Listener] = []  # the metrics (`trainer.api.metrics`)

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

    def view(self, row: OperationRow) -> OperationRow:
        """`row` as the catalogue has it, with any change it could not take yet applied."""
        with self._lock:
            changes = self._unrecorded.get(row.id)
        return replace(row, **changes) if changes else row

    def _record(self, op_id: str, **changes: Any) -> None:
        """Write a status change; on a full disk keep it in memory until `flush`."""
        changes["updated_at"] = time.time()
        with self._lock:
            changes = {**self._unrecorded.pop(op_id, {}), **changes}
        try:
            self.store.update(OperationRow, op_id, **changes)
        except Exception as exc:
            if not is_disk_full(exc):
                raise
            log.error("op %s: the catalogue is full; its status is kept in memory", op_id)
            with self._lock:
                self._unrecorded[op_id] = {**changes, **self._unrecorded.get(op_id, {})}

    def flush(self) -> int:
        """Write the changes a full disk refused; returns how many operations are still
        unwritten."""
        with self._lock:
            waiting = list(self._unrecorded)
        for op_id in waiting:
            with self._lock:
                changes = self._unrecorded.pop(op_id, None)
            if changes is None:
                continue
            try:
                self.store.update(OperationRow, op_id, **changes)
            except Exception as exc:  # still full (or another storage error): keep it
                with self._lock:  # a newer change recorded meanwhile wins
                    self._unrecorded[op_id] = {**changes, **self._unrecorded.get(op_id, {})}
                if not is_disk_full(exc):
                    log.exception("op %s: writing its status failed", op_id)
        with self._lock:
            return len(self._unrecorded)

    def fail(self, op_id: str, code: str, message: str) -> None:
        if not self.closed:
            self._record(op_id, status=OP_FAILED, error=op_error(code, message))

    def run(self, job: Job, postprocess: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        if self.closed:
            return
        self._record(job.op_id, status=OP_RUNNING)
        started = time.perf_counter()
        try:
            raw = job.call()
            output = postprocess(raw)
        except OperationError as exc:
            log.info("op %s %s failed: %s %s", job.kind, job.op_id, exc.code, exc.message)
            self.fail(job.op_id, exc.code, exc.message)
            self._tell(job, "failed", started, None)
            return
        except Exception as exc:  # the engine's bugs become data, not a dead worker thread
            log.exception("op %s %s crashed", job.kind, job.op_id)
            self.fail(job.op_id, "INTERNAL_ERROR", f"internal error: {type(exc).__name__}: {exc}")
            self._tell(job, "failed", started, None)
            return
        if not self.closed:
            self._record(job.op_id, status=OP_COMPLETED, output=output)
        log.info("op %s %s done in %.3fs", job.kind, job.op_id, time.perf_counter() - started)
        self._tell(job, "completed", started, raw)

    def _tell(self, job: Job, outcome: str, started: float, output: dict[str, Any] | None) -> None:
        seconds = time.perf_counter() - started
        for listener in self.listeners:
            listener(job, outcome, seconds, output)
