"""A fair, re-entrant compute lock: threads get their turns in arrival order.

`threading.RLock` is not fair: a thread that releases and at once re-acquires it usually gets
it back before a waiter wakes, so a long operation that "lets others in" between steps would
in practice starve them. `TurnLock` queues its waiters and hands the lock to the oldest one on
release: a thread that wants it back queues behind everyone already waiting.

`yield_turn()` is how a long operation (a sample's decode loop, `trainer/compute/sampler.py`) lets
the operations queued behind it run: when someone is waiting, the holder releases, lets every
thread that was waiting before it take its turn (each runs to the end of its hold, or to its
own `yield_turn`), and resumes when the lock comes back. It yields only a hold of depth one:
an outer holder (a caller that took the lock around the operation) keeps its atomicity.
"""

from __future__ import annotations

import threading
from collections import deque
from types import TracebackType


class TurnLock:
    """A re-entrant FIFO lock with `with`, `acquire`, `release` like `threading.RLock`."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._owner: int | None = None
        self._depth = 0
        self._queue: deque[object] = deque()  # one token per waiting thread, oldest first
        self.handoffs = 0  # turns given away by `yield_turn` (for tests and metrics)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return True
            if self._owner is None and not self._queue:
                self._owner, self._depth = me, 1
                return True
            if not blocking:
                return False
            token = object()
            self._queue.append(token)
            if not self._wait(token, None if timeout < 0 else timeout):
                return False
            self._owner, self._depth = me, 1
            return True

    def _wait(self, token: object, timeout: float | None) -> bool:
        """With `_cond` held and `token` queued: wait until the lock is free and `token` is
        the oldest waiter, then dequeue it (True). On a timeout or an exception (an interrupt)
        `token` leaves the queue, so the waiters behind it are not stuck."""
        try:
            ready = self._cond.wait_for(
                lambda: self._owner is None and self._queue[0] is token, timeout
            )
        except BaseException:
            self._queue.remove(token)
            self._cond.notify_all()
            raise
        if not ready:
            self._queue.remove(token)
            self._cond.notify_all()
            return False
        self._queue.popleft()
        return True

    def release(self) -> None:
        with self._cond:
            if self._owner != threading.get_ident():
                raise RuntimeError("cannot release a TurnLock this thread does not hold")
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._cond.notify_all()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def locked(self) -> bool:
        with self._cond:
            return self._owner is not None

    def held_here(self) -> bool:
        """Whether this thread holds the lock."""
        with self._cond:
            return self._owner == threading.get_ident()

    @property
    def waiting(self) -> int:
        """Threads queued for the lock now."""
        with self._cond:
            return len(self._queue)

    def yield_turn(self) -> bool:
        """Held once by this thread: if any thread is waiting, let every waiter run its turn
        first, then take the lock back (blocking). Returns whether others ran in between.
        Held more than once (an outer holder), or nobody waiting: returns False at once."""
        me = threading.get_ident()
        with self._cond:
            if self._owner != me:
                raise RuntimeError("cannot yield a TurnLock this thread does not hold")
            if self._depth != 1 or not self._queue:
                return False
            self.handoffs += 1
            # release and queue up again in one step: every earlier waiter goes first
            self._owner, self._depth = None, 0
            token = object()
            self._queue.append(token)
            self._cond.notify_all()
            self._wait(token, None)
            self._owner, self._depth = me, 1
            return True
