"""Disk full while a checkpoint is written: the operation FAILs with RESOURCE_EXHAUSTED and
"writing the checkpoint failed: No space left on device", nothing partial is left or listed,
the earlier checkpoints are byte-identical, and training (and checkpointing) continues.

Two ways to fill the disk: an injected `OSError(ENOSPC)` in the checkpoint writer (always), and
a real size-limited tmpfs as the storage directory (where the test may mount one, e.g. as root;
skipped elsewhere).

Every other write route on a full disk (catalogue rows in SQLite, payload uploads) answers 507
`insufficient_storage`, leaves no partial file and changes nothing; a result too large to
answer inline FAILs with RESOURCE_EXHAUSTED; all of it works again once space is freed.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.conftest import serve_in_thread
from tests.faults.procs import COMPLETED, FAILED, ce_batch, output, run_op, tiny_session
from trainer.checkpoint import store as checkpoints

TOKEN = "test-token-0123456789"  # tests/api/conftest.py's
FULL_MESSAGE = "writing the checkpoint failed: No space left on device"


def _fingerprint(storage: Path) -> dict[str, str]:
    root = storage / "checkpoints"
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _train(http: httpx.Client, sid: str, seed: int) -> int:
    output(http, sid, "forward-backward", ce_batch(seed))
    step: int = output(http, sid, "optim-step", {})["step"]
    return step


def _expect_full(http: httpx.Client, sid: str, storage: Path) -> None:
    before = _fingerprint(storage)
    listed = http.get("/rl/checkpoints").json()["data"]
    session = http.get(f"/rl/training-sessions/{sid}").json()
    for kind in ("training-checkpoint", "inference-checkpoint"):
        op = run_op(http, sid, kind)
        assert op["status"] == FAILED, op
        assert op["error"]["code"] == "TRAINING_OPERATION_ERROR_CODE_RESOURCE_EXHAUSTED", op
        assert op["error"]["message"] == FULL_MESSAGE, op
    assert not list((storage / "tmp").iterdir()), "the partial checkpoint is removed"
    assert _fingerprint(storage) == before, "earlier checkpoints are untouched"
    assert http.get("/rl/checkpoints").json()["data"] == listed
    after = http.get(f"/rl/training-sessions/{sid}").json()
    assert after["training_checkpoints"] == session["training_checkpoints"]
    assert after["step"] == session["step"] and after["status"] == session["status"]


def _continues(http: httpx.Client, sid: str, step: int) -> None:
    assert _train(http, sid, 7) == step + 1
    for kind in ("training-checkpoint", "inference-checkpoint"):
        op = run_op(http, sid, kind)
        assert op["status"] == COMPLETED, op
        assert op["output"]["checkpoint"]["step"] == step + 1


def test_injected_enospc(
    tiny_qwen_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = tmp_path / "storage"
    with serve_in_thread(storage, {"tiny-qwen": tiny_qwen_dir}) as live, live.client() as http:
        sid = tiny_session(http)
        step = _train(http, sid, 0)
        output(http, sid, "training-checkpoint")
        output(http, sid, "inference-checkpoint")

        def disk_full(paths: list[Path]) -> Any:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(paths[0]))

        monkeypatch.setattr(checkpoints, "seal_files", disk_full)
        _expect_full(http, sid, storage)
        monkeypatch.undo()
        _continues(http, sid, step)


@contextlib.contextmanager
def _tmpfs(path: Path, size: str) -> Iterator[None]:
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(storage: Path, leave: int) -> Path:
    """A filler file that leaves `leave` bytes free on the storage filesystem."""
    stat = os.statvfs(storage)
    free = stat.f_bavail * stat.f_frsize
    filler = storage / "filler.bin"
    with filler.open("wb") as handle:
        handle.truncate(0)
        block = b"\0" * (1 << 20)
        remaining = free - leave
        while remaining > 0:
            remaining -= handle.write(block[: min(len(block), remaining)])
    return filler


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_real_full_filesystem(tiny_qwen_dir: Path, tmp_path: Path) -> None:
    storage = tmp_path / "storage"
    with (
        _tmpfs(storage, "16m"),
        serve_in_thread(storage, {"tiny-qwen": tiny_qwen_dir}) as live,
        live.client() as http,
    ):
        sid = tiny_session(http, lora=False)  # full weights: checkpoints of 0.6-1.8 MB
        step = _train(http, sid, 0)
        sizes = [
            sum(p.stat().st_size for p in (storage / "checkpoints" / ckpt).rglob("*"))
            for ckpt in (
                output(http, sid, "training-checkpoint")["checkpoint"]["id"],
                output(http, sid, "inference-checkpoint")["checkpoint"]["id"],
            )
        ]
        # room for the catalogue's rows (it shares the disk), not for a checkpoint
        filler = _fill(storage, leave=min(sizes) // 2)
        _expect_full(http, sid, storage)
        filler.unlink()
        _continues(http, sid, step)


# -- every write route on a full disk ------------------------------------------------------


def _fill_up(storage: Path) -> Path:
    """A filler file that takes every last byte of the storage filesystem."""
    filler = storage / "filler.bin"
    with filler.open("wb", buffering=0) as handle:
        for block in (1 << 20, 1 << 12, 1):
            with contextlib.suppress(OSError):
                while True:
                    handle.write(b"\0" * block)
    return filler


def _write_routes(http: httpx.Client, rid: str, sid: str, upload_url: str) -> dict[str, int]:
    """One request on each route that writes (catalogue rows or payload files): its status.
    Never a 5xx other than 507, and a 507 says why."""
    ops = {
        "forward-backward": ce_batch(3),
        "training-checkpoint": {},
        "sample": {"model_inputs": [{"chunks": [{"encoded_text": {"tokens": [2, 3]}}]}]},
    }

    def op(kind: str) -> httpx.Response:
        return http.post(
            f"/rl/training-sessions/{sid}/operations/{kind}",
            json=ops[kind],
            headers={"Idempotency-Key": str(uuid.uuid4())},
        )

    session_url = f"/rl/training-sessions/{sid}"
    requests: dict[str, Any] = {
        "create resource": lambda: http.post("/rl/model-resources", json=RESOURCE),
        "create session": lambda: http.post(
            "/rl/training-sessions", json={"model_resources_id": rid}
        ),
        "patch": lambda: http.patch(session_url, json={"display_name": "x"}),
        "put payload": lambda: httpx.put(upload_url, content=PAYLOAD),
        "extend expiry": lambda: http.post(
            f"/rl/model-resources/{rid}/extend-expiry", json={"seconds": 600}
        ),
        **{kind: (lambda kind=kind: op(kind)) for kind in ops},
    }
    answers: dict[str, int] = {}
    for name, call in requests.items():
        response = call()
        assert response.status_code < 500 or response.status_code == 507, (name, response.text)
        if response.status_code == 507:
            error = response.json()["error"]
            assert error["code"] == "insufficient_storage" and "disk is full" in error["message"]
        answers[name] = response.status_code
    return answers


RESOURCE = {"base_model": "tiny-qwen", "lora_enabled": True}
PAYLOAD = json.dumps({"fill": list(range(50_000))}).encode()  # ~340 kB


def _setup(http: httpx.Client) -> tuple[str, str, str]:
    sid = tiny_session(http)
    rid = http.get(f"/rl/training-sessions/{sid}").json()["model_resources_id"]
    output(http, sid, "forward-backward", ce_batch(0))
    upload_url: str = http.post(f"/rl/training-sessions/{sid}/payloads/upload-url").json()[
        "upload_url"
    ]
    return rid, sid, upload_url


def _state(http: httpx.Client, sid: str) -> tuple[Any, ...]:
    session = http.get(f"/rl/training-sessions/{sid}").json()
    resources = http.get("/rl/model-resources", params={"limit": 100}).json()["data"]
    sessions = http.get("/rl/training-sessions", params={"limit": 100}).json()["data"]
    checkpoints = http.get("/rl/checkpoints", params={"limit": 100}).json()["data"]
    return (
        session["status"],
        session["step"],
        session.get("display_name"),
        [r["id"] for r in resources],
        [s["id"] for s in sessions],
        [c["id"] for c in checkpoints],
    )


def _no_partial_files(storage: Path, sid: str, upload_url: str) -> None:
    leftovers = [p for p in storage.rglob("*") if p.name.endswith((".part", ".tmp"))]
    assert not leftovers, leftovers
    payload_id = httpx.URL(upload_url).path.rsplit("/", 1)[-1]
    assert not (storage / "payloads" / sid / f"{payload_id}.json").exists()


def _recovers(http: httpx.Client, rid: str, sid: str, upload_url: str) -> None:
    """Space is back: every route that refused now works, with what it was given."""
    assert httpx.put(upload_url, content=PAYLOAD).status_code == 200
    payload_id = httpx.URL(upload_url).path.rsplit("/", 1)[-1]
    down = http.post(f"/rl/training-sessions/{sid}/payloads/{payload_id}/download-url").json()
    assert httpx.get(down["download_url"]).content == PAYLOAD
    assert http.patch(f"/rl/training-sessions/{sid}", json={"display_name": "x"}).status_code == 200
    step = http.get(f"/rl/training-sessions/{sid}").json()["step"]
    assert _train(http, sid, 5) == step + 1
    assert output(http, sid, "training-checkpoint")["checkpoint"]["step"] == step + 1
    other = http.post("/rl/training-sessions", json={"model_resources_id": rid})
    assert other.status_code == 200, other.text
    assert http.post(f"/rl/training-sessions/{sid}/stop").status_code == 200
    created = http.post("/rl/model-resources", json=RESOURCE)
    assert created.status_code == 200, created.text


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_every_write_route_on_a_real_full_filesystem(tiny_qwen_dir: Path, tmp_path: Path) -> None:
    """The catalogue and the payloads share a tmpfs filled to the last byte. Each write route
    used to be a 500 (`sqlite3.OperationalError: database or disk is full`), and a PUT left its
    `.part` behind. Now each is a 507 naming the cause, nothing partial is left, the state is
    as before, and everything works again once the space is freed."""
    storage = tmp_path / "storage"
    with (
        _tmpfs(storage, "16m"),
        serve_in_thread(storage, {"tiny-qwen": tiny_qwen_dir}) as live,
        live.client() as http,
    ):
        rid, sid, upload_url = _setup(http)
        before = _state(http, sid)
        filler = _fill_up(storage)
        answers = _write_routes(http, rid, sid, upload_url)
        answers["stop session"] = http.post(f"/rl/training-sessions/{sid}/stop").status_code
        assert set(answers.values()) == {507}, answers
        _no_partial_files(storage, sid, upload_url)
        assert _state(http, sid) == before
        filler.unlink()
        _recovers(http, rid, sid, upload_url)


def test_payload_writes_on_a_full_disk(
    tiny_qwen_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without root: file writes fail with ENOSPC at their fsync, as on a full disk. A PUT is
    a 507 and leaves no `.part`; an operation whose result is too large to answer inline FAILs
    with RESOURCE_EXHAUSTED (it was INTERNAL_ERROR) and leaves no file; both work again once
    the space is back."""
    storage = tmp_path / "storage"
    models = {"tiny-qwen": tiny_qwen_dir}
    with (
        serve_in_thread(storage, models, result_offload_bytes=1024) as live,
        live.client() as http,
    ):
        rid, sid, upload_url = _setup(http)
        forward = {**ce_batch(4), "forward_only": True, "return_loss_fn_outputs": True}

        def no_space(fd: int) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "fsync", no_space)
        response = httpx.put(upload_url, content=PAYLOAD)
        assert response.status_code == 507, response.text
        assert response.json()["error"]["code"] == "insufficient_storage"
        op = run_op(http, sid, "forward-backward", forward)
        assert op["status"] == FAILED, op
        assert op["error"]["code"] == "TRAINING_OPERATION_ERROR_CODE_RESOURCE_EXHAUSTED", op
        assert op["error"]["message"] == "storing the result failed: No space left on device"
        _no_partial_files(storage, sid, upload_url)
        assert not list((storage / "payloads" / sid).glob("*.json"))
        monkeypatch.undo()
        out = output(http, sid, "forward-backward", forward)
        assert out["payload_id"] and "loss_fn_outputs" not in out
        _recovers(http, rid, sid, upload_url)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_an_operation_running_when_the_disk_fills_still_finishes(tmp_path: Path) -> None:
    """The catalogue's disk fills while an operation runs, so neither RUNNING nor COMPLETED can
    be written (a real SQLITE_FULL). A client polling it must still see it finish, with its
    output, and the catalogue gets the outcome once space is back: it used to stay PENDING
    forever, and the client polled until its timeout."""
    from trainer.serving.catalogue import OP_PENDING, Catalogue, OperationRow
    from trainer.serving.queues import Job, OperationLog

    storage = tmp_path / "storage"
    with _tmpfs(storage, "4m"):
        store = Catalogue(storage / "worker.sqlite")
        oplog = OperationLog(store)
        done = oplog.create("ts_x", "forward-backward", "key-1", "hash")
        failed = oplog.create("ts_x", "forward-backward", "key-2", "hash")
        filler = _fill_up(storage)
        with pytest.raises(Exception, match="database or disk is full"):
            store.update(OperationRow, done.id, status="probe")  # the disk really is full

        def boom() -> dict[str, Any]:
            raise RuntimeError("engine bug")

        oplog.run(Job(done.id, "forward-backward", lambda: {"loss": 1.5}), lambda out: out)
        oplog.run(Job(failed.id, "forward-backward", boom), lambda out: out)
        raw = store.get(OperationRow, done.id)
        assert raw is not None and raw.status == OP_PENDING  # the catalogue could not take it
        seen = oplog.view(raw)
        assert (seen.status, seen.output) == (COMPLETED, {"loss": 1.5})
        seen_failed = oplog.view(store.get(OperationRow, failed.id))  # type: ignore[arg-type]
        assert seen_failed.status == FAILED
        assert seen_failed.error["code"] == "TRAINING_OPERATION_ERROR_CODE_INTERNAL_ERROR"
        assert oplog.flush() == 2  # still full: kept, not lost
        filler.unlink()
        assert oplog.flush() == 0
        store.close()
        reopened = Catalogue(storage / "worker.sqlite")  # what a restart reads
        row = reopened.get(OperationRow, done.id)
        assert row is not None and (row.status, row.output) == (COMPLETED, {"loss": 1.5})
        row_failed = reopened.get(OperationRow, failed.id)
        assert row_failed is not None and row_failed.status == FAILED
        reopened.close()
