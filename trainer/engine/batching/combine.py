"""Flat combining: one resource's concurrent calls run as groups, each caller keeping its order.

Each caller thread (a session's operation thread) adds its item and waits. The first waiting
caller becomes the combiner: it waits out the merge window, takes the pending items that fit
(`take`), runs them (`execute`), and marks every taken item done, with its result or its error,
before another combiner starts; the callers whose items ran return. A session's thread waits
for its own item, so each session's operations keep their FIFO order. Used by the shared
forward-backward passes (`trainer/engine/batching/pass_scheduler.py`), rank 0's grouped commands
under torchrun
(`trainer/distributed/batching.py`) and the sample batches
(`trainer/engine/batching/sample_batch.py`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Generic, Protocol, TypeVar


class Item(Protocol):
    error: BaseException | None
    done: bool
    taken: bool

    @property
    def result(self) -> object:
        """What `execute` gave the item when it succeeded (None until then)."""


class SessionItem(Item, Protocol):
    @property
    def session(self) -> object:
        """Whose call it is: one item per session in a group."""


T = TypeVar("T", bound=Item)
S = TypeVar("S", bound=SessionItem)


def one_per_session(pending: deque[S], budget: int, size: Callable[[S], int]) -> list[S]:
    """Pending items in arrival order, one per session, while their sizes fit in `budget` (the
    first always goes); the others stay pending, in order."""
    taken: list[S] = []
    left: deque[S] = deque()
    sessions: set[int] = set()
    used = 0
    while pending:
        item = pending.popleft()
        if id(item.session) in sessions or (taken and used + size(item) > budget):
            left.append(item)
            continue
        sessions.add(id(item.session))
        used += size(item)
        taken.append(item)
    pending.extend(left)
    return taken


class Combiner(Generic[T]):
    """`overlap`: the next group may start collecting while this one runs (samples: their
    generation yields its turn, so the next batch forms meanwhile); otherwise one at a time."""

    def __init__(self, overlap: bool = False) -> None:
        self.overlap = overlap
        self._cond = threading.Condition()
        self._pending: deque[T] = deque()
        self._busy = False

    def submit(
        self,
        item: T,
        window_s: float,
        take: Callable[[deque[T]], list[T]],
        execute: Callable[[list[T]], None],
        hold: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> None:
        """Return once `item` is done (its result or error set by `execute`). `take` picks a
        group from the pending items (under the combiner's lock); `hold` is held around taking
        and executing (the resource lock, where the group must be taken under it)."""
        with self._cond:
            self._pending.append(item)
        while True:
            with self._cond:
                while not item.done and (self._busy or item.taken):
                    self._cond.wait()
                if item.done:
                    return
                self._busy = True
            taken: list[T] = []
            combining = True  # this thread holds `_busy` until it lets the next one collect
            try:
                if window_s > 0:
                    time.sleep(window_s)
                with hold():
                    with self._cond:
                        taken = take(self._pending)
                        for each in taken:
                            each.taken = True
                        if self.overlap:  # later arrivals form the next group
                            self._busy = combining = False
                            self._cond.notify_all()
                    execute(taken)
            finally:
                self._settle(taken, combining)

    def _settle(self, taken: Iterable[T], combining: bool) -> None:
        with self._cond:
            if combining:
                self._busy = False
            for each in taken:
                if not each.done and each.error is None and each.result is None:
                    each.error = RuntimeError("a combined group ended without this call's result")
                each.done = True
            self._cond.notify_all()
