"""`trainer serve` as a real child process, and the HTTP helpers the fault tests share.

The child is started exactly as an operator would (`python -m trainer serve ...`), so kill -9,
SIGTERM and resident memory are those of the real worker process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from trainer.spawn import free_port, wait_healthy

REPO = Path(__file__).resolve().parents[2]
TOKEN = "fault-token-5b0d7c1e9a"
TERMINAL = ("TRAINING_OPERATION_STATUS_COMPLETED", "TRAINING_OPERATION_STATUS_FAILED")
COMPLETED, FAILED = TERMINAL
CE = {"type": "LOSS_TYPE_CROSS_ENTROPY"}


def child_env(token: str = TOKEN) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRAINER_API_TOKEN"}
    env.update(
        HF_HUB_OFFLINE="1",
        PYTHONPATH=str(REPO),
        TRAINER_API_TOKEN=token,
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


@dataclass
class Child:
    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def client(self, timeout: float = 120) -> httpx.Client:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        return httpx.Client(base_url=f"{self.url}/v1", headers=headers, timeout=timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill9(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=60)

    def terminate(self, timeout: float) -> tuple[int, float]:
        """SIGTERM; (exit code, seconds until the process was gone)."""
        started = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=timeout)
        return code, time.monotonic() - started


def serve_args(storage: Path, models: dict[str, Path], port: int, *extra: str) -> list[str]:
    args = [sys.executable, "-m", "trainer", "serve", "--host", "127.0.0.1"]
    args += ["--port", str(port), "--storage", str(storage), "--device", "cpu"]
    for name, path in models.items():
        args += ["--model", f"{name}={path}"]
    return [*args, *extra]


@contextlib.contextmanager
def serve_child(
    storage: Path, models: dict[str, Path], *extra: str, log_path: Path | None = None
) -> Iterator[Child]:
    """Start the worker, wait for /healthz, yield it; kill -9 whatever is left at the end."""
    port = free_port()
    log_path = log_path or storage.parent / f"worker-{port}.log"
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            serve_args(storage, models, port, *extra),
            env=child_env(),
            cwd=REPO,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    child = Child(proc, f"http://127.0.0.1:{port}", log_path)
    try:
        wait_healthy(child.url, proc.poll, interval=0.05, log_path=log_path)
        yield child
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)


def rss_kib(pid: int) -> int:
    """Resident set size of a process (Linux `/proc/PID/status`, VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


# -- HTTP ----------------------------------------------------------------------------------


def wait_status(http: httpx.Client, path: str, wanted: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        body: dict = http.get(path).json()
        if body.get("status") == wanted:
            return body
        if str(body.get("status")).endswith(("_ERROR", "_STOPPED", "_EXPIRED")):
            raise AssertionError(f"{path} is {body.get('status')}, not {wanted}: {body}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} stuck in {body.get('status')}: {body}")
        time.sleep(0.05)


def post_op(
    http: httpx.Client, sid: str, kind: str, body: dict[str, Any] | None = None, key: str = ""
) -> dict[str, Any]:
    url = f"/rl/training-sessions/{sid}/operations/{kind}"
    response = http.post(
        url, json=body or {}, headers={"Idempotency-Key": key or str(uuid.uuid4())}
    )
    assert response.status_code == 200, response.text
    op: dict[str, Any] = response.json()
    return op


def poll_op(http: httpx.Client, sid: str, kind: str, op: dict[str, Any]) -> dict[str, Any]:
    url = f"/rl/training-sessions/{sid}/operations/{kind}/{op['id']}"
    while op["status"] not in TERMINAL:
        time.sleep(0.02)
        op = http.get(url).json()
    return op


def run_op(
    http: httpx.Client, sid: str, kind: str, body: dict[str, Any] | None = None, key: str = ""
) -> dict[str, Any]:
    return poll_op(http, sid, kind, post_op(http, sid, kind, body, key))


def output(http: httpx.Client, sid: str, kind: str, body: dict[str, Any] | None = None) -> Any:
    op = run_op(http, sid, kind, body)
    assert op["status"] == COMPLETED, op
    return op["output"]


def new_resource(http: httpx.Client, base_model: str, **extra: Any) -> str:
    response = http.post("/rl/model-resources", json={"base_model": base_model, **extra})
    assert response.status_code == 200, response.text
    rid: str = response.json()["id"]
    wait_status(http, f"/rl/model-resources/{rid}", "MODEL_RESOURCES_STATUS_READY")
    return rid


def new_session(http: httpx.Client, rid: str, **extra: Any) -> str:
    body = {"model_resources_id": rid, **extra}
    response = http.post("/rl/training-sessions", json=body)
    assert response.status_code == 200, response.text
    sid: str = response.json()["id"]
    wait_status(http, f"/rl/training-sessions/{sid}", "TRAINING_SESSION_STATUS_RUNNING")
    return sid


def tiny_session(http: httpx.Client, lora: bool = True) -> str:
    """A RUNNING session on a new tiny-qwen resource: LoRA rank 4 (seed 0), or full weights."""
    rid = new_resource(http, "tiny-qwen", lora_enabled=lora)
    return new_session(http, rid, **({"lora_config": {"rank": 4, "seed": 0}} if lora else {}))


def model_input(tokens: list[int]) -> dict[str, Any]:
    return {"chunks": [{"encoded_text": {"tokens": tokens}}]}


def ce_sample(sequence: list[int], weights: list[float] | None = None) -> dict[str, Any]:
    """Cross-entropy sample: input = seq[:-1], targets = seq[1:]."""
    n = len(sequence) - 1
    return {
        "model_input": model_input(sequence[:-1]),
        "loss_fn_inputs": {
            "target_tokens": {"data": sequence[1:], "dtype": "int64"},
            "weights": {"data": weights if weights is not None else [1.0] * n, "dtype": "float32"},
        },
    }


def ce_batch(seed: int, n: int = 4, length: int = 24, vocab: int = 128) -> dict[str, Any]:
    import random

    rng = random.Random(seed)
    samples = [ce_sample([rng.randrange(2, vocab) for _ in range(length)]) for _ in range(n)]
    return {"loss": CE, "samples": samples}


def forward_logprobs(http: httpx.Client, sid: str, sequences: list[list[int]]) -> list[Any]:
    body = {
        "loss": CE,
        "samples": [ce_sample(s) for s in sequences],
        "forward_only": True,
        "return_loss_fn_outputs": True,
    }
    out = output(http, sid, "forward-backward", body)
    return [o["tensors"]["logprobs"]["data"] for o in out["loss_fn_outputs"]]


# -- pre-warmed workers (kill -9 loops) ------------------------------------------------------

# Imported once by a fork server; each worker is then forked from it and runs the real
# `trainer serve` entry point (`trainer.cli.main`), so a restart costs milliseconds instead of
# the interpreter's import time (torch + transformers take 5-20 s on a busy 2-core runner).
_PRELOAD = [
    "tests.faults.procs",
    "trainer.cli",
    "trainer.api.app",
    "trainer.api.server",
    "trainer.engine.resource",
    "trainer.engine.session",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.llama.modeling_llama",
    "peft",
]


def _serve_main(argv: list[str], log_path: str, token: str) -> None:
    """Body of a forked worker: logs to `log_path`, then `trainer serve ...` for real."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(child_env(token))
    import torch

    torch.set_num_threads(1)  # as OMP_NUM_THREADS=1 does for a fresh worker (see child_env)
    from trainer.cli import main

    sys.exit(main(argv))


@dataclass
class Forked:
    process: Any  # multiprocessing.Process
    url: str
    log_path: Path

    @property
    def pid(self) -> int:
        pid: int = self.process.pid
        return pid

    def client(self, timeout: float = 120) -> httpx.Client:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        return httpx.Client(base_url=f"{self.url}/v1", headers=headers, timeout=timeout)

    def kill9(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        self.process.join(60)
        assert self.process.exitcode == -signal.SIGKILL

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


_CONTEXT: Any = None


def _fork_context() -> Any:
    global _CONTEXT
    if _CONTEXT is None:
        import multiprocessing

        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(_PRELOAD)
    return _CONTEXT


@contextlib.contextmanager
def forked_worker(
    storage: Path, models: dict[str, Path], log_path: Path, *extra: str
) -> Iterator[Forked]:
    port = free_port()
    argv = serve_args(storage, models, port, *extra)[3:]  # drop `python -m trainer`
    process = _fork_context().Process(target=_serve_main, args=(argv, str(log_path), TOKEN))
    process.start()
    worker = Forked(process, f"http://127.0.0.1:{port}", log_path)
    try:

        def exitcode() -> int | None:
            return None if process.is_alive() else process.exitcode

        wait_healthy(worker.url, exitcode, interval=0.02, log_path=log_path)
        yield worker
    finally:
        if process.is_alive():
            os.kill(process.pid, signal.SIGKILL)
            process.join(60)


def terminate(worker: Forked | Child, timeout: float = 120) -> tuple[int | None, float]:
    """SIGTERM the worker; (exit code, seconds until it was gone)."""
    started = time.monotonic()
    os.kill(worker.pid, signal.SIGTERM)
    if isinstance(worker, Forked):
        worker.process.join(timeout)
        code = worker.process.exitcode
    else:
        code = worker.proc.wait(timeout=timeout)
    return code, time.monotonic() - started
