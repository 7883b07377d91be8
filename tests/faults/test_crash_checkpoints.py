"""kill -9 a worker at random moments while it writes checkpoints; after each restart every
listed checkpoint verifies and resumes, nothing partial is listed, and temporaries are swept."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.engine.helpers import make_resource
from trainer.checkpoints import CheckpointStore
from trainer.specs import SessionSpec

WORKER = Path(__file__).with_name("crash_worker.py")
KILLS_PER_KIND = int(os.environ.get("TRAINER_CRASH_KILLS", "10"))  # 20 kills in all


def _run_and_kill(model_dir: Path, storage: Path, kind: str, rng: random.Random) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), str(model_dir), str(storage), kind],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        # once the write loop runs, kill at a random moment inside it
        assert proc.stdout.readline().strip() == "saved"
        time.sleep(rng.uniform(0.0, 0.4))
    finally:
        proc.kill()  # SIGKILL: no cleanup of any kind runs
        proc.wait(timeout=30)


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_kill_during_checkpoint_writes(tiny_qwen_dir, tmp_path, kind) -> None:
    rng = random.Random(1234)
    storage = tmp_path / "storage"
    seen: set[str] = set()
    for _ in range(KILLS_PER_KIND):
        _run_and_kill(tiny_qwen_dir, storage, kind, rng)
        store = CheckpointStore(storage)  # the restart: recovery runs here
        assert not list((storage / "tmp").iterdir()), "temporaries are swept at start-up"
        listed = store.list(limit=1000)
        ids = {r.id for r in listed}
        assert seen <= ids, "a checkpoint listed before a crash is still listed after it"
        for record in listed:
            store.open(record.id)  # every file matches its manifest sha256
        on_disk = {p.name for p in (storage / "checkpoints").iterdir()}
        assert on_disk == ids, "no directory that the catalogue does not list"
        seen = ids
        store.close()
    assert len(seen) >= 4, "the worker got to write checkpoints between kills"

    resource = make_resource(tiny_qwen_dir, storage, lora=kind == "lora")
    for record in resource.store.list(limit=1000):
        session = resource.create_session(
            f"resume-{record.id}", SessionSpec(resume_from_checkpoint_id=record.id)
        )
        if record.type == "CHECKPOINT_TYPE_TRAINING":
            assert session.step == record.step
        resource.close_session(session.id)
