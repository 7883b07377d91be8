"""A full disk under the Tinker face's futures: a result whose write to `tinker.sqlite` fails
(SQLite's "database or disk is full") is held in memory and served to the client polling it,
then written once space is back, so it is served after a restart too. Never `try_again`
forever.

Two ways to fill the disk: an injected `SQLITE_FULL` on every write of a future (always), and
a real size-limited tmpfs as the storage directory, filled to the last byte while requests
wait on the engine (where the test may mount one, as root).
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.api.conftest import LiveServer, serve_in_thread
from tests.faults.test_disk_full import _fill_up, _tmpfs
from tests.tinker import tinker_http as th
from trainer.api.tinker.records import DONE, PENDING, TinkerFuture, TinkerRecords
from trainer.engine.resource import COMPUTE_LOCK


def stored(live: LiveServer, request_id: str) -> str:
    row = live.app.state.tinker.db.get(TinkerFuture, request_id)
    assert row is not None
    return row.status


def eventually(check: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.05)


def submit_forwards(http: httpx.Client, model: str, count: int) -> list[str]:
    ids = []
    for _ in range(count):
        response = http.post("/forward_backward", json=th.fb_body(model, True))
        assert response.status_code == 200, response.text
        ids.append(response.json()["request_id"])
    return ids


def served_after_restart(
    storage: Path, models: dict[str, Path], results: dict[str, dict[str, Any]]
) -> None:
    with serve_in_thread(storage, models) as again, th.client(again) as http:
        for request_id, result in results.items():
            assert stored(again, request_id) == DONE
            assert th.wait(http, request_id, timeout=15) == result


def test_injected_full_disk(
    tiny_qwen_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage, models = tmp_path / "storage", {th.BASE: tiny_qwen_dir}
    with serve_in_thread(storage, models) as live, th.client(live) as http:
        model = th.new_model(http)
        expected = th.forward(http, model)
        update = TinkerRecords.update

        def full(self: TinkerRecords, cls: type[Any], key: str, **changes: Any) -> None:
            if cls is TinkerFuture:
                raise sqlite3.OperationalError("database or disk is full")
            update(self, cls, key, **changes)

        monkeypatch.setattr(TinkerRecords, "update", full)
        ids = submit_forwards(http, model, 20)
        results = {request_id: th.wait(http, request_id, timeout=60) for request_id in ids}
        for result in results.values():
            assert th.logprobs(result) == expected
        assert {stored(live, request_id) for request_id in ids} == {PENDING}  # held, unwritten
        assert live.app.state.tinker.flush() == 20
        monkeypatch.undo()  # space is back: the periodic sweep writes them
        eventually(lambda: all(stored(live, request_id) == DONE for request_id in ids))
        assert live.app.state.tinker.flush() == 0
    served_after_restart(storage, models, results)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_real_full_filesystem(tiny_qwen_dir: Path, tmp_path: Path) -> None:
    """Six models' forwards wait on the engine while the disk fills to the last byte: each
    finishes and is served. A request queued behind one of them, whose operation the full
    catalogue cannot record, fails cleanly (server category, the disk named)."""
    storage, models = tmp_path / "storage", {th.BASE: tiny_qwen_dir}
    held, release = threading.Event(), threading.Event()

    def hold_the_engine() -> None:
        with COMPUTE_LOCK:
            held.set()
            release.wait(120)

    with _tmpfs(storage, "16m"):
        with serve_in_thread(storage, models) as live, th.client(live) as http:
            model_ids = [th.new_model(http) for _ in range(6)]
            expected = th.forward(http, model_ids[0])
            holder = threading.Thread(target=hold_the_engine, daemon=True)
            holder.start()
            assert held.wait(30)
            ids = [submit_forwards(http, model, 1)[0] for model in model_ids]
            behind = submit_forwards(http, model_ids[0], 1)[0]
            eventually(lambda: len(live.worker.oplog.futures) == len(ids))  # all wait on it
            bridge = live.app.state.tinker
            bridge.db._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # no slack in the WAL
            filler = _fill_up(storage)
            release.set()
            results = {request_id: th.wait(http, request_id, timeout=120) for request_id in ids}
            for result in results.values():  # a merged pass of the six: equal within 1e-6
                np.testing.assert_allclose(th.logprobs(result), expected, rtol=1e-5)
            failed = th.wait(http, behind, timeout=120)
            assert failed["category"] == "server" and "disk is full" in failed["error"], failed
            assert bridge.flush() > 0, "the full disk took every write"
            filler.unlink()
            eventually(lambda: all(stored(live, request_id) == DONE for request_id in ids))
            holder.join(30)
        served_after_restart(storage, models, results)
