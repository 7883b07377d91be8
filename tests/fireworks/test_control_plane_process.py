"""`python -m trainer serve` as a real process with a trainer job: SIGTERM drains and exits 0
with the job's resource stopped, and the restarted worker lists the job PAUSED, resumable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.api.conftest import TOKEN, serve_in_thread
from tests.fireworks.conftest import QWEN, REPO
from trainer.spawn import free_port, wait_healthy

pytestmark = pytest.mark.fireworks


def test_sigterm_drains_and_the_job_comes_back_paused(
    fw_models: dict[str, Path], tmp_path: Path
) -> None:
    storage, port = tmp_path / "storage", free_port()
    args = [
        sys.executable, "-m", "trainer", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--storage", str(storage), "--model", f"{QWEN}={fw_models[QWEN]}", "--device", "cpu",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "TRAINER_API_TOKEN": TOKEN}
    proc = subprocess.Popen(args, env=env, cwd=REPO, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc.poll, timeout=120)
        with httpx.Client(base_url=base, headers={"X-Api-Key": TOKEN}, timeout=60) as c:
            body = {"trainingConfig": {"baseModel": QWEN, "loraRank": 4}, "serviceMode": True}
            made = c.post("/v1/accounts/local/rlorTrainerJobs?rlorTrainerJobId=drained", json=body)
            assert made.json()["state"] == "JOB_STATE_RUNNING", made.text
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err.decode()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with serve_in_thread(storage, {QWEN: fw_models[QWEN]}) as live:
        c = httpx.Client(base_url=live.url, headers={"X-Api-Key": TOKEN}, timeout=60)
        job = c.get("/v1/accounts/local/rlorTrainerJobs/drained").json()
        assert job["state"] == "JOB_STATE_PAUSED", job
        resumed = c.post("/v1/accounts/local/rlorTrainerJobs/drained:resume").json()
        assert resumed["state"] == "JOB_STATE_RUNNING"
