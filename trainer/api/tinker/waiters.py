"""Long polls on futures: `retrieve_future` waits on the event loop, not in a thread.

A request's dispatcher thread calls `notify(request_id)` when it finishes; every coroutine
waiting on that id wakes. A poll that times out answers `try_again`, and the SDK polls again.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable


class Waiters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = {}

    async def wait(self, request_id: str, timeout: float, done: Callable[[], bool]) -> None:
        """Return once `done()` holds or `request_id` is notified, or after `timeout` seconds.
        The event is registered before `done()` is read, so a notification cannot slip
        between the two."""
        event = asyncio.Event()
        entry = (asyncio.get_running_loop(), event)
        with self._lock:
            self._events.setdefault(request_id, []).append(entry)
        try:
            if timeout <= 0 or done():
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(event.wait(), timeout)
        finally:
            with self._lock:
                waiting = self._events.get(request_id, [])
                if entry in waiting:
                    waiting.remove(entry)
                if not waiting:
                    self._events.pop(request_id, None)

    def notify(self, request_id: str) -> None:
        with self._lock:
            waiting = list(self._events.get(request_id, []))
        for loop, event in waiting:
            with contextlib.suppress(RuntimeError):  # the loop has closed
                loop.call_soon_threadsafe(event.set)
