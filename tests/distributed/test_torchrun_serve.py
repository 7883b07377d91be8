"""`torchrun --nproc-per-node 2 -m trainer serve`: rank 0 serves HTTP, the SDK drives both ranks.

A LoRA session trains three cross-entropy steps over two gloo ranks; the losses equal those of
the same calls on a one-process worker, and SIGTERM stops every rank.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer.spawn import free_port, wait_healthy

pytestmark = pytest.mark.distributed

TOKEN = "torchrun-test-token"
SAMPLES = [
    {
        "model_input": {"chunks": [{"encoded_text": {"tokens": [5, 6, 7, 8, 9]}}]},
        "loss_fn_inputs": {
            "target_tokens": {"data": [6, 7, 8, 9, 10], "dtype": "int64"},
            "weights": {"data": [1, 1, 1, 1, 1], "dtype": "float32"},
        },
    },
    {
        "model_input": {"chunks": [{"encoded_text": {"tokens": [20, 21, 22]}}]},
        "loss_fn_inputs": {
            "target_tokens": {"data": [21, 22, 23], "dtype": "int64"},
            "weights": {"data": [0, 1, 1], "dtype": "float32"},
        },
    },
    {
        "model_input": {"chunks": [{"encoded_text": {"tokens": [40, 41, 42, 43]}}]},
        "loss_fn_inputs": {
            "target_tokens": {"data": [41, 42, 43, 44], "dtype": "int64"},
            "weights": {"data": [1, 1, 1, 1], "dtype": "float32"},
        },
    },
]


def _launch(ranks: int, model_dir: Path, storage: Path, port: int) -> subprocess.Popen:
    serve = [
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--storage",
        str(storage),
        "--model",
        f"tiny={model_dir}",
        "--device",
        "cpu",
    ]
    if ranks == 1:
        cmd = [sys.executable, "-m", "trainer", *serve]
    else:
        torchrun = shutil.which("torchrun") or "torchrun"
        cmd = [
            torchrun,
            "--standalone",
            f"--nproc-per-node={ranks}",
            f"--master-port={free_port()}",
            "-m",
            "trainer",
            *serve,
        ]
    env = {**os.environ, "TRAINER_API_TOKEN": TOKEN, "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def _train(port: int, proc: subprocess.Popen) -> list[float]:
    from together.post_training import ModelResourcesClient

    wait_healthy(f"http://127.0.0.1:{port}", proc.poll, timeout=120, interval=0.5)
    resource = ModelResourcesClient.create(
        api_key=TOKEN, base_url=f"http://127.0.0.1:{port}/v1", base_model="tiny"
    )
    try:
        session = resource.create_session(lora_config={"rank": 4, "seed": 3})
        losses = []
        for _ in range(3):
            out = session.trainer.forward_backward(
                samples=SAMPLES, loss={"type": "LOSS_TYPE_CROSS_ENTROPY"}
            )
            losses.append(float(out.loss))
            session.trainer.optim_step(adam_params={"learning_rate": 1e-2})
        return losses
    finally:
        resource.stop(force=True)


def _run(ranks: int, model_dir: Path, storage: Path) -> list[float]:
    port = free_port()
    proc = _launch(ranks, model_dir, storage, port)
    pids = [proc.pid]
    try:
        losses = _train(port, proc)
        pids += _children(proc.pid) if ranks > 1 else []
    finally:
        code = _stop(proc, pids)
    if ranks == 1:
        assert code == 0
    assert len(pids) == (ranks + 1 if ranks > 1 else 1), pids
    return losses


def _stop(proc: subprocess.Popen, pids: list[int]) -> int:
    """SIGTERM the job (torchrun forwards it to every rank); fails unless the launcher and
    every one of `pids` are gone within 30 s. torchrun itself exits 1 on a signal (its
    SignalException) after the ranks have stopped: the exit code is returned, not checked."""
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        raise
    _wait_gone(pids, 30, "a rank outlived SIGTERM")
    return code


def test_two_rank_worker_matches_one_process(tiny_qwen_dir, tmp_path) -> None:
    two = _run(2, tiny_qwen_dir, tmp_path / "two")
    one = _run(1, tiny_qwen_dir, tmp_path / "one")
    assert two == pytest.approx(one, rel=1e-4)
    assert two[-1] < two[0]


def _children(pid: int) -> list[int]:
    """`pid`'s child processes (Linux): torchrun starts each rank in a session of its own, so
    the agent's process group does not hold them."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _running(pid: int) -> bool:
    """True while `pid` exists and is not a zombie awaiting its (new) parent's reaping."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_gone(pids: list[int], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while any(_running(p) for p in pids):
        assert time.monotonic() < deadline, what
        time.sleep(0.5)


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc")
def test_ranks_leave_with_a_killed_agent(tiny_qwen_dir, tmp_path) -> None:
    """torchrun's agent SIGKILLed cannot stop its ranks; they notice and stop themselves, so
    no rank keeps the port or the device."""
    import socket

    port = free_port()
    proc = _launch(2, tiny_qwen_dir, tmp_path, port)
    ranks: list[int] = []
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc.poll, timeout=120, interval=0.5)
        ranks = _children(proc.pid)
        assert len(ranks) == 2, ranks
        proc.kill()  # the agent only: its ranks are orphaned
        proc.wait(timeout=30)
        _wait_gone(ranks, 45, "a rank outlived its agent")
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
    finally:
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
