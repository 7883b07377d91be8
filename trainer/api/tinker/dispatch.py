"""The Tinker face's dispatchers: one FIFO of requests per owner (a model, a sampling session).

An owner's requests run one at a time, in arrival order, on a thread that lives only while the
owner has work: it starts when a request arrives at an idle owner and ends once the owner's
queue is empty, so idle models and samplers hold no thread and no entry here. The threads are
daemons: a request stuck in the engine never keeps the process from exiting.

At shutdown `stop` refuses new requests and hands back the queued ones (for the caller to fail
cleanly); `join` waits for the running ones to end.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass
class Task:
    request_id: str
    run: Callable[[], None]


class Dispatchers:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        # owner -> its tasks; the first one is running. An owner is here iff its thread lives.
        self._queues: dict[str, deque[Task]] = {}
        self.stopped = False

    def submit(self, owner: str, task: Task) -> bool:
        """Queue `task` after the owner's earlier ones; False once `stop` has run."""
        with self._lock:
            if self.stopped:
                return False
            queue = self._queues.get(owner)
            if queue is not None:
                queue.append(task)
                return True
            self._queues[owner] = deque([task])
        threading.Thread(
            target=self._drain, args=(owner,), name=f"tinker-{owner[-24:]}", daemon=True
        ).start()
        return True

    def _drain(self, owner: str) -> None:
        while True:
            with self._lock:
                task = self._queues[owner][0]
            try:
                task.run()
            except Exception:  # `run` records its own failures; this is a last resort
                log.exception("tinker request %s: its dispatcher caught an error", task.request_id)
            with self._lock:
                queue = self._queues[owner]
                queue.popleft()
                if not queue:
                    del self._queues[owner]
                    self._idle.notify_all()
                    return

    def stop(self) -> list[str]:
        """Refuse new requests; the queued ones (not started) are dropped and their request
        ids returned. The running ones go on (`join` waits for them)."""
        with self._lock:
            self.stopped = True
            dropped: list[str] = []
            for queue in self._queues.values():
                running = queue.popleft()
                dropped.extend(task.request_id for task in queue)
                queue.clear()
                queue.append(running)
        return dropped

    def join(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds until no request runs; True if none does."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._queues, timeout)

    def active(self) -> int:
        """How many owners have a dispatcher thread now."""
        with self._lock:
            return len(self._queues)
