"""Run the worker: resolve the token, build the app, preload, serve until SIGTERM/SIGINT.

uvicorn turns SIGTERM into a graceful shutdown: it stops accepting connections, finishes the
requests in flight, then runs the app's lifespan exit (`trainer.api.app`), where the Tinker face
fails its queued requests and lets its running ones finish, then the worker refuses new
operations, fails queued ones, gives the running ones what is left of `shutdown_grace_s` and
flushes its catalogue, and the Tinker records close last. The process then exits 0. An
operation that outlived the grace is recorded FAILED while its thread is still inside torch:
the process then leaves with `os._exit(0)` (logs and stdio flushed) instead of tearing the
interpreter down under that thread, which aborts (SIGABRT, "terminate called without an
active exception") or segfaults.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvicorn
from pydantic import ValidationError

from trainer.api.app import create_app
from trainer.api.keys import KeyRing, KeysFileError
from trainer.api.signing import RedactSignatures
from trainer.serving.config import ServeConfig, is_loopback
from trainer.serving.errors import ApiError
from trainer.serving.lifecycle import Loader
from trainer.serving.requests import CreateResourceBody, CreateSessionBody
from trainer.serving.worker import Worker

log = logging.getLogger(__name__)

TOKEN_ENV = "TRAINER_API_TOKEN"


class StartupError(Exception):
    """A setting that stops the worker from starting; the message says which and why."""


def resolve_token(config: ServeConfig, environ: dict[str, str] | None = None) -> str | None:
    """`--token-file` wins over `TRAINER_API_TOKEN`; no token needs `--no-auth` on loopback."""
    env = os.environ if environ is None else environ
    token: str | None = None
    if config.token_file is not None:
        if not config.token_file.is_file():
            raise StartupError(f"--token-file {config.token_file}: no such file")
        token = config.token_file.read_text().strip()
        if not token:
            raise StartupError(f"--token-file {config.token_file}: the file is empty")
    elif env.get(TOKEN_ENV, "").strip():
        token = env[TOKEN_ENV].strip()
    if token is not None:
        return token
    if not config.no_auth:
        raise StartupError(
            f"no API token: set {TOKEN_ENV} or pass --token-file (or --no-auth on a loopback "
            "host for local experiments)"
        )
    if not is_loopback(config.host):
        raise StartupError(f"--no-auth is only allowed on a loopback host, not {config.host!r}")
    return None


def resolve_keys(config: ServeConfig, environ: dict[str, str] | None = None) -> KeyRing:
    """The keys in force: `--keys FILE` (a malformed file stops the start, naming the line),
    else the single token of `resolve_token`."""
    if config.keys_file is None:
        return KeyRing(token=resolve_token(config, environ))
    if not config.keys_file.is_file():
        raise StartupError(f"--keys {config.keys_file}: no such file")
    try:
        return KeyRing(config.keys_file)
    except KeysFileError as exc:
        raise StartupError(f"--keys {exc}") from None


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise StartupError(f"{what} {path}: {exc}") from None
    if not isinstance(value, dict):
        raise StartupError(f"{what} {path}: expected a JSON object")
    return value


def preload(worker: Worker, resource_file: Path | None, session_file: Path | None) -> None:
    """Create the resource (loads in the background) and, once READY, the session."""
    resource_id: str | None = None
    if resource_file is not None:
        raw = _read_json(resource_file, "--resource")
        ident = raw.pop("id", None)
        try:
            body = CreateResourceBody.model_validate(raw)
            resource_id = worker.create_resource(body, ident).id
        except ValidationError as exc:
            raise StartupError(f"--resource {resource_file}: {exc}") from None
        except ApiError as exc:
            raise StartupError(f"--resource {resource_file}: {exc.message}") from None
    if session_file is None:
        return
    raw = _read_json(session_file, "--session")
    ident = raw.pop("id", None)
    raw.setdefault("model_resources_id", resource_id)
    try:
        session_body = CreateSessionBody.model_validate(raw)
    except ValidationError as exc:
        raise StartupError(f"--session {session_file}: {exc}") from None

    def open_when_ready() -> None:
        live = worker.resources.get_live(session_body.model_resources_id)
        if live is not None:
            live.ready.wait()
        try:
            worker.create_session(session_body, ident)
        except ApiError as exc:
            log.error("--session %s: %s", session_file, exc.message)

    threading.Thread(target=open_when_ready, name="preload-session", daemon=True).start()


class _Server(uvicorn.Server):
    """uvicorn re-raises SIGTERM after its graceful shutdown, so the process would die by the
    signal; the worker's contract is a clean exit 0 once it has drained and flushed."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def serve(config: ServeConfig, log_level: str = "info", loader: Loader | None = None) -> int:
    """`loader` builds the engine of each resource (default: one process, `load_resource`;
    under torchrun: `trainer.distributed.resource_loader`, rank 0's SPMD proxies)."""
    keys = resolve_keys(config)
    worker = Worker(config, loader=loader)
    freeze_long_lived()
    preload(worker, config.resource_file, config.session_file)
    app = create_app(worker, None, keys)
    log.info(
        "serving %d model(s) on http://%s:%d (auth %s)",
        len(config.models),
        config.host,
        config.port,
        "off" if keys.open else f"{len(keys.users())} user(s)",
    )
    if config.keys_file is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGHUP, lambda *_: keys.reload())
    server = _Server(uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level))
    logging.getLogger("uvicorn.access").addFilter(RedactSignatures())
    server.run()
    if worker.abandoned:
        exit_now(0, f"{len(worker.abandoned)} abandoned operation(s) still computing")
    return 0


def freeze_long_lived() -> None:
    """Take every object alive now (~0.3 M: modules, classes, functions, which live as long as
    the process) out of the cyclic collector's scans (`gc.freeze`); a loaded model and the
    modules its load imported follow (`ResourceManager._load`). A full collection, which a
    large request body's allocations trigger, then scans only newer objects: it pauses the
    event loop (and `/healthz`) for milliseconds instead of ~0.4 s."""
    gc.collect()
    gc.freeze()


def exit_now(code: int, why: str) -> None:
    """Leave without interpreter teardown: the catalogue is already flushed and closed, but a
    thread still computes in torch, whose C++ state must not be destroyed under it."""
    log.warning("exiting now (%s)", why)
    logging.shutdown()  # flushes every handler
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
