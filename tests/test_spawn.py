"""`trainer.spawn`, the one helper that starts a worker process and waits for `/healthz` (the
demo, the benchmarks and the process tests use it): it waits for a real worker, says why one
that dies or hangs never became healthy, and stops it with SIGTERM, or SIGKILL past the grace."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

from trainer import spawn

# A stand-in worker: /healthz answers 200 after `delay` seconds; SIGTERM exits 0 after `linger`.
FAKE = """
import http.server, signal, sys, time
port, delay, linger = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
print("fake worker starting", flush=True)
time.sleep(delay)
def on_term(*_):
    time.sleep(linger)
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/healthz" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def _fake(port: int, delay: float = 0.0, linger: float = 0.0) -> list[str]:
    return [sys.executable, "-c", FAKE, str(port), str(delay), str(linger)]


def test_free_ports_are_bindable_and_distinct() -> None:
    import socket

    ports = {spawn.free_port() for _ in range(20)}
    assert len(ports) > 1
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports.pop()))


def test_waits_for_health_and_stops_with_sigterm(tmp_path: Path) -> None:
    port = spawn.free_port()
    started = time.monotonic()
    with spawn.serve(_fake(port, delay=1.0), port, tmp_path / "w.log", interval=0.05) as worker:
        assert time.monotonic() - started >= 1.0
        assert worker.url == f"http://127.0.0.1:{port}"
        assert httpx.get(f"{worker.url}/healthz").status_code == 200
        process = worker.process
    assert process.returncode == 0  # SIGTERM, handled: a clean exit, no SIGKILL
    assert "fake worker starting" in (tmp_path / "w.log").read_text()


def test_sigkill_past_the_grace_or_at_once(tmp_path: Path) -> None:
    port = spawn.free_port()
    worker = spawn.WorkerProcess(_fake(port, linger=30), port, tmp_path / "w.log")
    worker.wait_ready(timeout=60, interval=0.05)
    started = time.monotonic()
    worker.stop(grace=0.5)
    assert worker.process.returncode == -signal.SIGKILL
    assert time.monotonic() - started < 10
    port = spawn.free_port()
    worker = spawn.WorkerProcess(_fake(port), port, tmp_path / "w2.log")
    worker.wait_ready(timeout=60, interval=0.05)
    worker.stop(grace=None)
    assert worker.process.returncode == -signal.SIGKILL


def test_a_worker_that_exits_is_an_error_quoting_its_log(tmp_path: Path) -> None:
    command = [sys.executable, "-c", "import sys; print('no model here', flush=True); sys.exit(3)"]
    started = time.monotonic()
    with (
        pytest.raises(RuntimeError, match=r"exited with code 3[\s\S]*no model here"),
        spawn.serve(command, spawn.free_port(), tmp_path / "w.log", timeout=60),
    ):
        pass
    assert time.monotonic() - started < 30  # not the timeout


def test_a_worker_that_never_answers_times_out_and_is_stopped(tmp_path: Path) -> None:
    command = [sys.executable, "-c", "import time; print('stuck', flush=True); time.sleep(60)"]
    worker = spawn.WorkerProcess(command, spawn.free_port(), tmp_path / "w.log")
    with pytest.raises(TimeoutError, match=r"/healthz in 1s[\s\S]*stuck"):
        worker.wait_ready(timeout=1.0, interval=0.05)
    worker.stop(grace=5)
    assert worker.process.returncode == -signal.SIGTERM


def test_the_benchmark_serves_a_real_worker(tiny_qwen_dir: Path) -> None:
    """Row 7's `trainer serve` child, through the shared helper: up, answering the API, gone."""
    from benchmarks.arms_http import serve

    with serve(str(tiny_qwen_dir)) as api:
        models = httpx.get(f"{api}/rl/supported-models", timeout=30)
        assert models.status_code == 200, models.text
        assert "bench" in models.text
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{api}/rl/supported-models", timeout=5)
