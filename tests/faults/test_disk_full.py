"""Disk full while a checkpoint is written: the operation FAILs with RESOURCE_EXHAUSTED and
"writing the checkpoint failed: No space left on device", nothing partial is left or listed,
the earlier checkpoints are byte-identical, and training (and checkpointing) continues.

Two ways to fill the disk: an injected `OSError(ENOSPC)` in the checkpoint writer (always), and
a real size-limited tmpfs as the storage directory (where the test may mount one, e.g. as root;
skipped elsewhere).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.conftest import serve_in_thread
from tests.faults.procs import COMPLETED, FAILED, ce_batch, output, run_op
from trainer import checkpoints

TOKEN = "test-token-0123456789"  # tests/api/conftest.py's
FULL_MESSAGE = "writing the checkpoint failed: No space left on device"


def _fingerprint(storage: Path) -> dict[str, str]:
    root = storage / "checkpoints"
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _session(http: httpx.Client, lora: bool = True) -> str:
    resource = {"base_model": "tiny-qwen", "lora_enabled": lora}
    rid = http.post("/rl/model-resources", json=resource).json()["id"]
    _wait(http, f"/rl/model-resources/{rid}", "MODEL_RESOURCES_STATUS_READY")
    body: dict[str, Any] = {"model_resources_id": rid}
    if lora:
        body["lora_config"] = {"rank": 4, "seed": 0}
    sid: str = http.post("/rl/training-sessions", json=body).json()["id"]
    _wait(http, f"/rl/training-sessions/{sid}", "TRAINING_SESSION_STATUS_RUNNING")
    return sid


def _wait(http: httpx.Client, path: str, status: str) -> None:
    import time

    deadline = time.monotonic() + 60
    while http.get(path).json()["status"] != status:
        assert time.monotonic() < deadline, path
        time.sleep(0.05)


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
        sid = _session(http)
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
        sid = _session(http, lora=False)  # full weights: checkpoints of 0.6-1.8 MB
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
