"""`trainer.engine.batching.combine`: flat combining keeps each caller's items in order, groups
concurrent ones,
and (without `overlap`) never runs two groups at once."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import pytest

from trainer.engine.batching.combine import Combiner, one_per_session


@dataclass
class _Item:
    session: str
    size: int
    value: int
    result: Any = None
    error: BaseException | None = None
    done: bool = False
    taken: bool = False


def test_one_per_session_keeps_order_and_budget() -> None:
    pending = deque(
        [_Item("a", 3, 0), _Item("a", 1, 1), _Item("b", 4, 2), _Item("c", 2, 3), _Item("d", 9, 4)]
    )
    taken = one_per_session(pending, 6, lambda i: i.size)
    assert [i.value for i in taken] == [0, 3]  # b (3+4 > 6) and a's second wait; c fits
    assert [i.value for i in pending] == [1, 2, 4]
    assert [i.value for i in one_per_session(deque([_Item("x", 99, 7)]), 1, lambda i: i.size)] == [
        7
    ]


@pytest.mark.parametrize("overlap", [False, True])
def test_groups_complete_every_item_in_order(overlap: bool) -> None:
    combiner: Combiner[_Item] = Combiner(overlap=overlap)
    lock = threading.Lock()
    state: dict[str, Any] = {"running": 0, "max_running": 0, "groups": []}

    def take(pending: deque[_Item]) -> list[_Item]:
        return one_per_session(pending, 100, lambda i: i.size)

    def execute(group: list[_Item]) -> None:
        with lock:
            state["running"] += 1
            state["max_running"] = max(state["max_running"], state["running"])
            state["groups"].append(len(group))
        time.sleep(0.01)
        for item in group:
            item.result = item.value * 2
        with lock:
            state["running"] -= 1

    results: dict[str, list[int]] = {}

    def caller(session: str) -> None:
        for n in range(5):
            item = _Item(session, 1, n)
            combiner.submit(item, 0.002, take, execute)
            assert item.done and item.error is None
            results.setdefault(session, []).append(item.result)

    threads = [threading.Thread(target=caller, args=(f"s{k}",)) for k in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert all(results[f"s{k}"] == [0, 2, 4, 6, 8] for k in range(6))  # each in its order
    if not overlap:
        assert state["max_running"] == 1
    assert max(state["groups"]) > 1  # concurrent callers shared groups


def test_an_item_left_without_result_gets_an_error() -> None:
    combiner: Combiner[_Item] = Combiner()
    item = _Item("a", 1, 0)
    combiner.submit(item, 0.0, lambda p: [p.popleft()], lambda group: None)
    assert item.done and isinstance(item.error, RuntimeError)
