"""Soak: 8 concurrent SDK clients on 4 LoRA sessions of one resource, against the real worker
process, with polling and deliberate retries that reuse idempotency keys.

Each client runs rounds on its session (two clients share each session): it pipelines a
forward-backward and two optim-steps without waiting, re-POSTs each with the same key (the
original operation must come back, never a new one), then polls them; every fifth round adds a
weights-sync and a sample. At the end:

- no lost or duplicated operation: each session's step is exactly the number of distinct
  optim-step keys sent to it, and the steps the clients saw are exactly 1..N, each once;
- per-session order: each client's two optim-steps complete in the order they were sent;
- the worker's resident memory (VmRSS) after warm-up grows by less than 5% over the run.

Default: about 1,000 operations (`TRAINER_SOAK_ROUNDS`, default 40 rounds per client); the
`slow` variant runs 5x more.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from together import Together

from tests.faults.procs import (
    TOKEN,
    ce_batch,
    forked_worker,
    model_input,
    new_resource,
    new_session,
    rss_kib,
)

ROUNDS = int(os.environ.get("TRAINER_SOAK_ROUNDS", "40"))
CLIENTS, SESSIONS = 8, 4
DONE = ("TRAINING_OPERATION_STATUS_COMPLETED", "TRAINING_OPERATION_STATUS_FAILED")


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    operations: int = 0  # distinct operations (keys)
    retries: int = 0
    polls: int = 0
    rounds: int = 0
    steps: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    optim_keys: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    errors: list[str] = field(default_factory=list)


def _poll(ops: Any, kind: str, sid: str, op: Any, tally: Tally) -> Any:
    retrieve = getattr(ops, f"retrieve_{kind}")
    while op.status not in DONE:
        time.sleep(0.01)
        op = retrieve(op.id, session_id=sid)
        with tally.lock:
            tally.polls += 1
    return op


def _submit(ops: Any, kind: str, sid: str, tally: Tally, **body: Any) -> Any:
    """POST, then retry with the same key: the worker must answer the same operation."""
    key = str(uuid.uuid4())
    first = getattr(ops, kind)(sid, idempotency_key=key, **body)
    again = getattr(ops, kind)(sid, idempotency_key=key, **body)
    assert again.id == first.id, f"a retry of {kind} made a new operation"
    with tally.lock:
        tally.operations += 1
        tally.retries += 1
        if kind == "optim_step":
            tally.optim_keys[sid] += 1
    return first


def _client(url: str, sid: str, index: int, rounds: int, tally: Tally) -> None:
    client = Together(api_key=TOKEN, base_url=f"{url}/v1", max_retries=0)
    ops = client.post_training.operations
    try:
        for r in range(rounds):
            batch = ce_batch(1000 * index + r, n=2, length=12)
            fb = _submit(ops, "forward_backward", sid, tally, **batch)
            first = _submit(ops, "optim_step", sid, tally, adam_params={"learning_rate": 1e-3})
            second = _submit(ops, "optim_step", sid, tally, adam_params={"learning_rate": 1e-3})
            assert _poll(ops, "forward_backward", sid, fb, tally).status == DONE[0]
            a = _poll(ops, "optim_step", sid, first, tally)
            b = _poll(ops, "optim_step", sid, second, tally)
            assert a.status == b.status == DONE[0], (a, b)
            step_a, step_b = int(a.output.step), int(b.output.step)
            assert step_a < step_b, f"order broken: {step_a} then {step_b}"
            with tally.lock:
                tally.steps[sid] += [step_a, step_b]
            if r % 5 == 4:
                sync = _submit(
                    ops, "weights_sync", sid, tally, weight_sync_type="WEIGHT_SYNC_TYPE_SYNCHRONOUS"
                )
                assert _poll(ops, "weights_sync", sid, sync, tally).status == DONE[0]
                sample = _submit(
                    ops,
                    "sample",
                    sid,
                    tally,
                    model_inputs=[model_input([3, 17, 42])],
                    num_samples=2,
                    sampling_params={"max_tokens": 4, "seed": r},
                )
                assert _poll(ops, "sample", sid, sample, tally).status == DONE[0]
            with tally.lock:
                tally.rounds += 1
    except AssertionError as exc:
        with tally.lock:
            tally.errors.append(f"client {index}: {exc}")
    finally:
        client.close()


def _soak(tiny_qwen_dir: Path, tmp_path: Path, rounds: int) -> None:
    models = {"tiny-qwen": tiny_qwen_dir}
    with (
        forked_worker(tmp_path / "storage", models, tmp_path / "soak.log") as worker,
        worker.client() as http,
    ):
        rid = new_resource(http, "tiny-qwen", inactive_timeout=3600)
        sids = [new_session(http, rid, lora_config={"rank": 4, "seed": i}) for i in range(SESSIONS)]
        tally = Tally()
        threads = [
            threading.Thread(
                target=_client, args=(worker.url, sids[i % SESSIONS], i, rounds, tally)
            )
            for i in range(CLIENTS)
        ]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        warm_at = CLIENTS * max(2, rounds // 10)
        samples: list[tuple[float, int]] = []
        warm_rss: int | None = None
        while any(t.is_alive() for t in threads):
            time.sleep(0.25)
            rss = rss_kib(worker.pid)
            samples.append((time.monotonic() - started, rss))
            if warm_rss is None and tally.rounds >= warm_at:
                warm_rss = rss
        for thread in threads:
            thread.join()
        elapsed = time.monotonic() - started
        final_rss = rss_kib(worker.pid)
        assert not tally.errors, tally.errors
        for sid in sids:
            session = http.get(f"/rl/training-sessions/{sid}").json()
            expected = tally.optim_keys[sid]
            assert session["step"] == expected, (sid, session["step"], expected)
            assert sorted(tally.steps[sid]) == list(range(1, expected + 1)), sid
    assert warm_rss is not None
    peak = max(rss for _, rss in samples)
    growth = (final_rss - warm_rss) / warm_rss
    print(
        f"soak: {tally.operations} operations (+{tally.retries} retries, {tally.polls} polls) "
        f"by {CLIENTS} clients on {SESSIONS} sessions in {elapsed:.0f}s; RSS after warm-up "
        f"{warm_rss / 1024:.1f} MiB, final {final_rss / 1024:.1f} MiB ({growth:+.2%}), "
        f"peak {peak / 1024:.1f} MiB"
    )
    assert growth < 0.05, f"RSS grew {growth:.1%} after warm-up"


def test_soak(tiny_qwen_dir: Path, tmp_path: Path) -> None:
    _soak(tiny_qwen_dir, tmp_path, ROUNDS)


@pytest.mark.slow
def test_soak_long(tiny_qwen_dir: Path, tmp_path: Path) -> None:
    _soak(tiny_qwen_dir, tmp_path, 5 * ROUNDS)
