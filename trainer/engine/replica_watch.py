"""A watched sample on a vLLM replica: its progress, seen on the sampling thread, and its
cancellation (`vllm_child/vllm_replica.py`'s `watch` and `cancel`)."""

from __future__ import annotations

import queue
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

WATCH_POLL_S = 0.05  # how often a watched sample with no new tokens asks its watch


class RowWatch(Protocol):
    """What `ReplicaPool.generate` tells a watched sample: `progress([[row, tokens,
    logprobs], ...])` after each engine step that made tokens, and `stopped()`."""

    def progress(self, rows: list[Any]) -> None: ...

    def stopped(self) -> bool: ...


class Requests(Protocol):
    """What a watched sample needs of its replica (`replicas.Replica`), named here so this
    module never imports the pool that imports it."""

    def new_id(self) -> str: ...

    def request(
        self,
        message: dict[str, Any],
        request_id: str | None = None,
        progress: Callable[[list[Any]], None] | None = None,
    ) -> Future[dict[str, Any]]: ...


def watched(replica: Requests, message: dict[str, Any], watch: RowWatch) -> dict[str, Any]:
    """A generate request whose progress `watch` sees on this thread (the replica's reader
    only queues it), cancelled once the watch says stop."""
    updates: queue.SimpleQueue[list[Any]] = queue.SimpleQueue()
    request_id = replica.new_id()
    future = replica.request(message, request_id, updates.put)
    cancelled = False
    try:
        while True:
            try:
                rows = updates.get(timeout=WATCH_POLL_S)
            except queue.Empty:
                rows = None
            if rows is not None:
                watch.progress(rows)
            if not cancelled and watch.stopped():
                cancelled = True
                replica.request({"op": "cancel", "job": request_id})  # no reply awaited
            if future.done() and updates.empty():
                return future.result()
    except BaseException:
        if not cancelled:  # a watch that raised: its rows stop generating
            replica.request({"op": "cancel", "job": request_id})
        raise
