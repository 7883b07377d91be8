"""kill -9 the real worker (`trainer serve`, driven over HTTP) at random moments while it trains
and writes training and inference checkpoints, LoRA and full weights, then restart it on the
same storage. After every restart:

- leftover temporaries are gone (`tmp/` is empty once the worker answers);
- no partial checkpoint is listed: the listed ids are exactly the directories on disk, and every
  file of every listed checkpoint matches its manifest sha256;
- nothing listed before a crash disappears, and both SQLite catalogues pass `integrity_check`;
- every new checkpoint resumes through the API: a training checkpoint at its step, with the
  logprobs the session had when it was written (bit for bit), then takes an optim-step; an
  inference checkpoint as weights;
- crash during an operation: every operation that completed before the kill still reads back
  COMPLETED with the same output, the one in flight reads FAILED (worker restarted) or
  COMPLETED, and the session that ran it is STOPPED.

`TRAINER_API_CRASH_KILLS` sets the number of kills (default 20, alternating LoRA and full).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.faults.procs import (
    COMPLETED,
    FAILED,
    TERMINAL,
    ce_batch,
    forked_worker,
    forward_logprobs,
    new_resource,
    new_session,
    output,
    poll_op,
    post_op,
)

KILLS = int(os.environ.get("TRAINER_API_CRASH_KILLS", "20"))
PROBE = [[5, 9, 33, 70, 2, 101, 64, 7], [11, 3, 3, 90, 45]]
# one training round, as the client sends it; "probe" records the logprobs after a checkpoint
ROUND = ["forward-backward", "optim-step", "training-checkpoint", "probe", "inference-checkpoint"]
CHECKPOINT_OPS = ("training-checkpoint", "inference-checkpoint")
KINDS = {"lora": "tiny-qwen", "full": "tiny-llama"}


@dataclass
class History:
    """What the client knows across kills."""

    listed: set[str] = field(default_factory=set)
    verified: set[str] = field(default_factory=set)
    probes: dict[str, list[Any]] = field(default_factory=dict)  # training ckpt -> logprobs
    completed: dict[tuple[str, str, str], Any] = field(default_factory=dict)  # op -> output
    in_flight: list[tuple[str, str, str]] = field(default_factory=list)
    stopped_sessions: list[str] = field(default_factory=list)
    leftovers: int = 0


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _integrity(db: Path) -> None:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok", db


def _list_checkpoints(http: httpx.Client) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    after = ""
    while True:
        page = http.get("/rl/checkpoints", params={"limit": 100, "after": after}).json()
        out += page["data"]
        if not page["meta"]["has_more"]:
            return out
        after = page["meta"]["next_cursor"]


def _check_recovered(storage: Path, http: httpx.Client, history: History) -> list[dict]:
    assert not list((storage / "tmp").iterdir()), "temporaries are swept at start-up"
    listed = _list_checkpoints(http)
    ids = {c["id"] for c in listed}
    assert history.listed <= ids, "a checkpoint listed before a crash is still listed"
    on_disk = {p.name for p in (storage / "checkpoints").iterdir()}
    assert on_disk == ids, f"unlisted directories {on_disk - ids}, missing {ids - on_disk}"
    for ckpt_id in ids:
        root = storage / "checkpoints" / ckpt_id
        manifest = json.loads((root / "manifest.json").read_text())
        files = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}
        assert files == {*manifest["files"], "manifest.json"}, ckpt_id
        for rel, info in manifest["files"].items():
            assert _sha256(root / rel) == info["sha256"], f"{ckpt_id}/{rel}"
    history.listed = ids
    for key, out in history.completed.items():
        sid, kind, op_id = key
        op = http.get(f"/rl/training-sessions/{sid}/operations/{kind}/{op_id}").json()
        assert op["status"] == COMPLETED and op.get("output") == out, (key, op)
    for sid, kind, op_id in history.in_flight:
        op = http.get(f"/rl/training-sessions/{sid}/operations/{kind}/{op_id}").json()
        assert op["status"] in TERMINAL, op
        if op["status"] == FAILED:
            assert op["error"]["code"].endswith("SESSION_NOT_ACTIVE"), op
    for sid in history.stopped_sessions:
        status = http.get(f"/rl/training-sessions/{sid}").json()["status"]
        assert status == "TRAINING_SESSION_STATUS_STOPPED", (sid, status)
    return listed


def _resources(http: httpx.Client) -> dict[str, str]:
    return {
        "lora": new_resource(http, KINDS["lora"], inactive_timeout=600),
        "full": new_resource(http, KINDS["full"], lora_enabled=False, inactive_timeout=600),
    }


def _verify_new(
    http: httpx.Client, listed: list[dict], resources: dict[str, str], history: History
) -> None:
    """Resume every checkpoint not resumed yet, through the API, and use it."""
    for ckpt in listed:
        if ckpt["id"] in history.verified:
            continue
        kind = "full" if ckpt["base_model"] == KINDS["full"] else "lora"
        training = ckpt["type"] == "CHECKPOINT_TYPE_TRAINING"
        sid = new_session(
            http,
            resources[kind],
            resume_from_checkpoint_id=ckpt["id"],
            load_optimizer=training,
        )
        session = http.get(f"/rl/training-sessions/{sid}").json()
        if training:
            assert session["step"] == ckpt["step"], (session, ckpt)
            probe = history.probes.get(ckpt["id"])
            if probe is not None:
                assert forward_logprobs(http, sid, PROBE) == probe, "exact resume"
            assert output(http, sid, "optim-step", {})["step"] == ckpt["step"] + 1
        else:
            assert len(forward_logprobs(http, sid, PROBE)) == len(PROBE)
        stopped = http.post(f"/rl/training-sessions/{sid}/stop").json()
        assert stopped["status"] == "TRAINING_SESSION_STATUS_STOPPED"
        history.verified.add(ckpt["id"])


def _train_until_killed(
    http: httpx.Client, sid: str, kill: Any, rng: random.Random, history: History
) -> None:
    """Run rounds; post op number `target` and kill -9 a random moment later."""
    ops = [ROUND[i % len(ROUND)] for i in range(3 * len(ROUND))]
    checkpoints = [i for i, op in enumerate(ops) if op in CHECKPOINT_OPS and i >= 2]
    others = [i for i, op in enumerate(ops) if op not in CHECKPOINT_OPS and op != "probe"]
    target = rng.choice(checkpoints) if rng.random() < 0.75 else rng.choice(others[1:])
    last_training: str | None = None
    for i, kind in enumerate(ops):
        if kind == "probe":
            if last_training is not None:
                history.probes[last_training] = forward_logprobs(http, sid, PROBE)
            continue
        body = ce_batch(i) if kind == "forward-backward" else {}
        op = post_op(http, sid, kind, body)
        if i == target:
            time.sleep(rng.uniform(0.0, 0.12 if kind in CHECKPOINT_OPS else 0.04))
            kill()
            history.in_flight.append((sid, kind, op["id"]))
            history.stopped_sessions.append(sid)
            return
        op = poll_op(http, sid, kind, op)
        assert op["status"] == COMPLETED, op
        history.completed[(sid, kind, op["id"])] = op["output"]
        if kind == "training-checkpoint":
            last_training = op["output"]["checkpoint"]["id"]
    raise AssertionError("the kill plan did not fire")


def test_kill9_during_checkpoint_writes_through_the_api(
    tiny_qwen_dir: Path, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    _crash_loop(tiny_qwen_dir, tiny_llama_dir, tmp_path, KILLS)


@pytest.mark.slow
def test_kill9_long(tiny_qwen_dir: Path, tiny_llama_dir: Path, tmp_path: Path) -> None:
    _crash_loop(tiny_qwen_dir, tiny_llama_dir, tmp_path, 5 * KILLS)


def _crash_loop(tiny_qwen_dir: Path, tiny_llama_dir: Path, tmp_path: Path, kills: int) -> None:
    storage = tmp_path / "storage"
    models = {KINDS["lora"]: tiny_qwen_dir, KINDS["full"]: tiny_llama_dir}
    rng = random.Random(20261129)
    history = History()
    started = time.monotonic()
    config = tmp_path / "worker.toml"
    config.write_text("op_inline_wait_s = 0\n")  # POSTs answer at once: kills land mid-write
    for cycle in range(kills + 1):  # the last start only checks what the last kill left
        log = tmp_path / f"worker-{cycle}.log"
        with (
            forked_worker(storage, models, log, "--config", str(config)) as worker,
            worker.client() as http,
        ):
            listed = _check_recovered(storage, http, history)
            resources = _resources(http)
            _verify_new(http, listed, resources, history)
            if cycle == kills:
                break
            kind = ("lora", "full")[cycle % 2]
            extra = {"lora_config": {"rank": 4, "seed": cycle}} if kind == "lora" else {}
            sid = new_session(http, resources[kind], **extra)
            _train_until_killed(http, sid, worker.kill9, rng, history)
        history.leftovers += len(list((storage / "tmp").iterdir()))
        _integrity(storage / "catalog.sqlite")
        _integrity(storage / "worker.sqlite")
    elapsed = time.monotonic() - started
    during_writes = sum(1 for _, kind, _ in history.in_flight if kind in CHECKPOINT_OPS)
    print(
        f"{kills} kills in {elapsed:.0f}s: {during_writes} aimed at checkpoint writes, "
        f"{history.leftovers} left a partial checkpoint behind, {len(history.verified)} "
        f"checkpoints resumed, {len(history.completed)} completed operations re-read"
    )
    assert len(history.verified) >= kills // 2, "the worker wrote checkpoints between kills"
    assert during_writes >= kills // 2
