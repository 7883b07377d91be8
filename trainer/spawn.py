"""A worker as a child process: a free loopback port, the process logging to a file, a wait for
`/healthz`, and a stop. The one helper behind `trainer demo`, the benchmarks and the tests.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

LOG_TAIL = 3000  # characters of the worker's log quoted when it fails to start


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _tail(log_path: Path | None) -> str:
    if log_path is None or not log_path.exists():
        return ""
    return f"; {log_path}:\n" + log_path.read_text(errors="replace")[-LOG_TAIL:]


def wait_healthy(
    url: str,
    returncode: Callable[[], int | None],
    *,
    timeout: float = 120.0,
    interval: float = 0.1,
    log_path: Path | None = None,
) -> None:
    """Poll `GET {url}/healthz` until it answers 200. `returncode()` is the worker's exit code,
    None while it runs: a RuntimeError if it exits first, a TimeoutError past `timeout` seconds
    (both quote the end of `log_path`)."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/healthz", timeout=5).status_code == 200:
                return
        code = returncode()
        if code is not None:
            raise RuntimeError(f"the worker exited with code {code}{_tail(log_path)}")
        if time.monotonic() > deadline:
            message = f"the worker did not answer /healthz in {timeout:.0f}s{_tail(log_path)}"
            raise TimeoutError(message)
        time.sleep(interval)


class WorkerProcess:
    """`command` (a worker serving on 127.0.0.1:`port`) started with its output in `log_path`."""

    def __init__(
        self,
        command: list[str],
        port: int,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        with log_path.open("wb") as log:  # the child holds its own descriptor
            self.process = subprocess.Popen(
                command,
                env=None if env is None else dict(env),
                cwd=cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_ready(self, timeout: float = 120.0, interval: float = 0.1) -> None:
        wait_healthy(
            self.url, self.process.poll, timeout=timeout, interval=interval, log_path=self.log_path
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, grace: float | None = 60.0) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds (None: SIGKILL at once)."""
        if self.process.poll() is not None:
            return
        if grace is not None:
            self.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(grace)
                return
        self.process.kill()
        self.process.wait()


@contextlib.contextmanager
def serve(
    command: list[str],
    port: int,
    log_path: Path,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float = 120.0,
    interval: float = 0.1,
    grace: float | None = 60.0,
) -> Iterator[WorkerProcess]:
    """Start the worker, wait until it is healthy, yield it; stop it (`grace`) at the end."""
    worker = WorkerProcess(command, port, log_path, env, cwd)
    try:
        worker.wait_ready(timeout, interval)
        yield worker
    finally:
        worker.stop(grace)
