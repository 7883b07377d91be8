"""A resource's vLLM generator replicas: child processes the worker starts, supervises and
stops (`trainer/engine/vllm_replica.py` is the child).

Each replica speaks JSON lines over a Unix socket. `ReplicaPool` starts
`num_generator_replicas` of them and waits until each is healthy (a replica that cannot start
fails the resource with vLLM's own reason; one that cannot serve the model exactly makes it
sample in-process: `replica_check.py`), sends each sample to the replica with the fewest
rows in flight, restarts a replica that dies (the samples it held fail with a clear error,
naming the replica and its exit; full weights pushed before are pushed again before it
serves), and stops them all when the resource closes. Design notes: `docs/design/vllm.md`.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.contract.errors import OperationError
from trainer.contract.generation import GeneratorOptions
from trainer.engine.replica_check import (
    GeneratorFallback,
    check,
    fallback_message,
    logged_cause,
    model_type,
    unsupported,
)
from trainer.engine.replica_settings import replica_config
from trainer.engine.replica_watch import RowWatch, watched

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from trainer.contract.specs import ModelEntry

log = logging.getLogger(__name__)

SCRIPT = Path(__file__).with_name("vllm_child") / "vllm_replica.py"
_LOG_TAIL = 2000


def start_replicas(
    entry: ModelEntry,
    options: GeneratorOptions,
    *,
    count: int,
    lora: bool,
    tokenizer: bool,
    device: torch.device,
    model: Any = None,
) -> ReplicaPool:
    """`count` healthy replicas of `entry` (raises `ReplicaStartError` with vLLM's reason).
    Given the loaded `model` (the weights the replicas load), one replica's logprobs are
    checked against it; a model vLLM cannot serve exactly raises `GeneratorFallback`
    (`replica_check`)."""
    config = replica_config(entry, options, lora=lora, tokenizer=tokenizer, device=device)
    kind = model_type(model, Path(config["model"]))
    pool = ReplicaPool(count, options, config, cuda=device.type == "cuda")
    try:
        pool.start()
        why = None if model is None else check(pool, model, config["dtype"], lora=lora)
    except (ReplicaStartError, OperationError) as exc:
        pool.close()
        if not unsupported(str(exc)):
            if isinstance(exc, ReplicaStartError):
                raise
            raise ReplicaStartError(f"vLLM replica failed its first sample: {exc}") from exc
        why = str(exc)
    except BaseException:
        pool.close()
        raise
    if why is None:
        return pool
    pool.close()
    message = f"{fallback_message(kind, why)}; its samples run on the in-process loop"
    log.warning("%s", message)
    raise GeneratorFallback(message)


class ReplicaStartError(RuntimeError):
    """A replica could not start: the message carries vLLM's own reason."""


class ReplicaDied(OperationError):
    def __init__(self, message: str) -> None:
        super().__init__("INTERNAL_ERROR", message)


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count()


def sync_root() -> Path:
    """Where pushed weights and adapters are written: shared memory when there is some."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="trainer-vllm-", dir=base))


class Replica:
    """One child process and the connection to it."""

    def __init__(self, index: int, python: str, config: dict[str, Any], workdir: Path) -> None:
        self.index = index
        self.python = python
        self.config = config
        self.workdir = workdir
        self.process: subprocess.Popen[bytes] | None = None
        self.state = "STARTING"
        self.pid: int | None = None
        self.restarts = 0
        self.rows_in_flight = 0
        self.samples = 0  # sample calls it answered
        self._conn: socket.socket | None = None
        self._send_lock = threading.Lock()
        self._pending: dict[str, Future[dict[str, Any]]] = {}
        self._progress: dict[str, Callable[[list[Any]], None]] = {}  # watched requests
        self._pending_lock = threading.Lock()
        self._ids = itertools.count()
        self.log_path = workdir / f"replica-{index}.log"

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, timeout_s: float) -> None:
        """Spawn the child, connect, wait for its first line: ready, or vLLM's reason."""
        sock_path = self.workdir / f"replica-{self.index}.sock"
        sock_path.unlink(missing_ok=True)
        env = {
            **os.environ,
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_KVCACHE_SPACE": str(self.config.get("kv_cache_gib", 1)),
            "VLLM_CONFIGURE_LOGGING": "1",
            "PYTHONUNBUFFERED": "1",
        }
        # the child imports vllm and its own folder, never this worker's packages
        env["PYTHONPATH"] = str(SCRIPT.parent)
        for key, value in (self.config.get("env") or {}).items():
            env[key] = str(value)
        command = [
            self.python,
            str(SCRIPT),
            "--socket",
            str(sock_path),
            "--config",
            json.dumps(self.config),
        ]
        with self.log_path.open("ab") as out:
            try:
                self.process = subprocess.Popen(
                    command,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    start_new_session=True,
                )
            except OSError as exc:
                raise ReplicaStartError(f"cannot run {self.python}: {exc}") from exc
        self.pid = self.process.pid
        deadline = time.monotonic() + timeout_s
        conn = self._connect(sock_path, deadline)
        conn.settimeout(max(1.0, deadline - time.monotonic()))
        reader = conn.makefile("rb")
        try:
            first = reader.readline()
        except (TimeoutError, OSError):
            first = b""
        if not first:
            self.stop()
            raise ReplicaStartError(self._reason("did not become ready"))
        hello = json.loads(first)
        if not hello.get("ready"):
            self.stop()
            cause = logged_cause(self.log_path, str(hello.get("error")))
            raise ReplicaStartError(f"vLLM could not start: {hello.get('error')}{cause}")
        conn.settimeout(None)
        self._conn = conn
        self.state = "HEALTHY"
        threading.Thread(
            target=self._read, args=(reader,), name=f"vllm-replica-{self.index}", daemon=True
        ).start()

    def _connect(self, sock_path: Path, deadline: float) -> socket.socket:
        assert self.process is not None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ReplicaStartError(self._reason("exited before it listened"))
            if sock_path.exists():
                conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    conn.connect(str(sock_path))
                    return conn
                except OSError:
                    conn.close()
            time.sleep(0.05)
        self.stop()
        raise ReplicaStartError(self._reason("timed out starting"))

    def _reason(self, what: str) -> str:
        code = None if self.process is None else self.process.poll()
        tail = self.log_tail()
        return f"vLLM replica {self.index} {what} (exit code {code}): {tail}"

    def log_tail(self) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        lines = [ln for ln in text.splitlines() if ln.strip()]
        errors = [ln for ln in lines if "Error" in ln or "error" in ln]
        return (errors[-1] if errors else "\n".join(lines[-3:]))[-_LOG_TAIL:]

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        """Close the connection (the child exits on EOF), then terminate, then kill."""
        self.state = "STOPPED"
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.close()
        process = self.process
        if process is not None and process.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(process.pid, 15)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError):
                    os.killpg(process.pid, 9)
                process.wait()
        self._fail_pending(f"generator replica {self.index} stopped")

    # -- requests --------------------------------------------------------------------------

    def new_id(self) -> str:
        return f"{self.index}.{next(self._ids)}"

    def request(
        self,
        message: dict[str, Any],
        request_id: str | None = None,
        progress: Callable[[list[Any]], None] | None = None,
    ) -> Future[dict[str, Any]]:
        """The reply to `message`; a watched generate's progress lines go to `progress`
        (called on the reading thread) before it."""
        future: Future[dict[str, Any]] = Future()
        if self.state != "HEALTHY" or self._conn is None:
            future.set_exception(ReplicaDied(f"generator replica {self.index} is {self.state}"))
            return future
        request_id = request_id or self.new_id()
        with self._pending_lock:
            self._pending[request_id] = future
            if progress is not None:
                self._progress[request_id] = progress
        line = (json.dumps({**message, "id": request_id}) + "\n").encode()
        try:
            with self._send_lock:
                self._conn.sendall(line)
        except OSError:
            with self._pending_lock:
                self._pending.pop(request_id, None)
                self._progress.pop(request_id, None)
            future.set_exception(ReplicaDied(self._died_message()))
        return future

    def _read(self, reader: Any) -> None:
        try:
            for line in reader:
                reply = json.loads(line)
                request_id = str(reply.get("id"))
                with self._pending_lock:
                    if "progress" in reply:
                        progress = self._progress.get(request_id)
                        if progress is not None:
                            progress(reply["progress"])
                        continue
                    future = self._pending.pop(request_id, None)
                    self._progress.pop(request_id, None)
                if future is not None and not future.done():
                    future.set_result(reply)
        except (OSError, ValueError):
            pass
        if self.state == "HEALTHY":
            self.state = "DEAD"
        self._fail_pending(self._died_message())

    def _died_message(self) -> str:
        code = None if self.process is None else self.process.poll()
        return (
            f"generator replica {self.index} died mid-sample (exit code {code}); it is "
            "being restarted: retry the sample"
        )

    def _fail_pending(self, message: str) -> None:
        with self._pending_lock:
            pending, self._pending = self._pending, {}
            self._progress.clear()
        for future in pending.values():
            if not future.done():
                future.set_exception(ReplicaDied(message))


class ReplicaPool:
    """`count` replicas of one model (the module docstring)."""

    def __init__(
        self,
        count: int,
        options: GeneratorOptions,
        config: dict[str, Any],
        cuda: bool = False,
    ) -> None:
        self.options = options
        self.model_path = config["model"]
        self.workdir = sync_root()
        python = options.python or sys.executable
        devices = _cuda_count() if cuda else 0
        self.replicas = [
            Replica(
                i,
                python,
                {**config, "env": {"CUDA_VISIBLE_DEVICES": str(i % devices)}}
                if devices
                else config,
                self.workdir,
            )
            for i in range(count)
        ]
        self._weights_path: str | None = None  # the full weights pushed last
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._supervisor: threading.Thread | None = None
        self.sync_seconds: list[float] = []
        # sessions whose samples run in-process (an adapter vLLM refused): session -> why
        self.in_process: dict[str, str] = {}

    def start(self) -> None:
        """Start every replica at once; the first failure stops them all and is raised."""
        errors: list[BaseException] = []

        def one(replica: Replica) -> None:
            try:
                replica.start(self.options.start_timeout_s)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(r,)) for r in self.replicas]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            self.close()
            raise errors[0]
        self._supervisor = threading.Thread(
            target=self._supervise, name="vllm-supervisor", daemon=True
        )
        self._supervisor.start()

    def _supervise(self) -> None:
        """Restart a replica that died, then push the full weights it served again."""
        while not self._closed.wait(0.25):
            for replica in self.replicas:
                if self._closed.is_set() or replica.alive() or replica.state == "STOPPED":
                    continue
                log.warning("vLLM replica %d died: restarting", replica.index)
                replica.state = "RESTARTING"
                replica.stop()
                replica.state = "RESTARTING"
                replica.restarts += 1
                try:
                    replica.start(self.options.start_timeout_s)
                    if self._weights_path is not None:
                        self._call(replica, {"op": "load_weights", "path": self._weights_path})
                except BaseException as exc:  # try again on the next round
                    log.error("vLLM replica %d did not restart: %s", replica.index, exc)
                    replica.state = "DEAD"
                    if replica.process is not None and replica.process.poll() is None:
                        replica.stop()
                        replica.state = "DEAD"

    def describe(self) -> dict[str, Any]:
        """`status_details.generator`: the replicas, and the sessions served in-process."""
        described: dict[str, Any] = {"backend": "vllm", "replicas": self.status()}
        if self.in_process:
            described["in_process_sessions"] = dict(self.in_process)
        return described

    def status(self) -> list[dict[str, Any]]:
        return [
            {
                "index": r.index,
                "state": r.state,
                "pid": r.pid,
                "restarts": r.restarts,
                "rows_in_flight": r.rows_in_flight,
                "samples": r.samples,
            }
            for r in self.replicas
        ]

    @property
    def healthy(self) -> bool:
        return all(r.state == "HEALTHY" for r in self.replicas)

    def close(self) -> None:
        self._closed.set()
        for replica in self.replicas:
            replica.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    # -- work ------------------------------------------------------------------------------

    @staticmethod
    def _call(replica: Replica, message: dict[str, Any]) -> dict[str, Any]:
        reply = replica.request(message).result()
        if "error" in reply:
            raise RuntimeError(f"generator replica {replica.index}: {reply['error']}")
        return reply

    def _every(self, message: dict[str, Any]) -> None:
        """`message` on every replica that serves; one that is restarting gets it on start
        (full weights) or reads it when a row names it (adapters)."""
        futures = [(r, r.request(message)) for r in self.replicas if r.state == "HEALTHY"]
        for replica, future in futures:
            try:
                reply = future.result()
            except ReplicaDied:
                continue  # its restart pushes what it needs
            if "error" in reply:
                raise RuntimeError(f"generator replica {replica.index}: {reply['error']}")

    def load_adapter(self, adapter: dict[str, Any]) -> None:
        self._every({"op": "load_adapter", "adapter": adapter})

    def drop_adapter(self, adapter_id: int) -> None:
        self._every({"op": "drop_adapter", "adapter_id": adapter_id})

    def load_weights(self, path: Path, restarts: bool = True) -> None:
        """Full weights in place (`restarts`: pushed again to a replica that restarts)."""
        start = time.perf_counter()
        with self._lock:
            self._weights_path = str(path) if restarts else self._weights_path
            self._every({"op": "load_weights", "path": str(path)})
        self.sync_seconds.append(time.perf_counter() - start)

    def generate(
        self, rows: list[dict[str, Any]], params: dict[str, Any], watch: RowWatch | None = None
    ) -> list[dict[str, Any]]:
        """Each row's tokens, logprobs and finish reason, from one replica. A `watch` is
        told each step's new tokens and asked whether to stop, on this thread; once it says
        stop, the rows end with what they have (finish `cancelled`)."""
        with self._lock:
            live = [r for r in self.replicas if r.state == "HEALTHY"]
            if not live:
                states = ", ".join(f"{r.index}: {r.state}" for r in self.replicas)
                raise ReplicaDied(f"no generator replica is serving ({states}): retry")
            replica = min(live, key=lambda r: r.rows_in_flight)
            replica.rows_in_flight += len(rows)
        try:
            message = {"op": "generate", "rows": rows, "params": params}
            if watch is None:
                reply = replica.request(message).result()
            else:
                reply = watched(replica, {**message, "watch": True}, watch)
        finally:
            with self._lock:
                replica.rows_in_flight -= len(rows)
        if "error" in reply:
            raise OperationError(
                "INTERNAL_ERROR", f"generator replica {replica.index}: {reply['error']}"
            )
        replica.samples += 1
        result: list[dict[str, Any]] = reply["rows"]
        return result
