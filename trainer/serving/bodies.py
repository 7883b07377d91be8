"""Request bodies off the event loop and off the GIL: spooled, parsed in a child process.

Design notes: `docs/design/serving.md`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import IO, Any

import numpy as np
import orjson
from fastapi import Request
from fastapi.concurrency import run_in_threadpool

from trainer.serving.bodychild import load_decoder
from trainer.serving.errors import ApiError, bad_request, is_disk_full
from trainer.serving.jsonparse import KINDS, BodyError, Bounds
from trainer.serving.jsonscan import decode_object

log = logging.getLogger(__name__)

INLINE_MAX = 1 << 20  # bodies up to this size are decoded in a worker thread
PARSE_TIMEOUT_S = 600.0
MAX_WAITING = 8


class BodyParser:
    """The child process that parses large bodies, and the spool directory it reads from.
    `bounds`: what a body may hold (`Bounds`), checked as it is decoded."""

    def __init__(
        self,
        spool_dir: Path,
        *,
        inline_max: int = INLINE_MAX,
        timeout_s: float = PARSE_TIMEOUT_S,
        max_waiting: int = MAX_WAITING,
    ) -> None:
        self.spool_dir = spool_dir
        self.inline_max = inline_max
        self.timeout_s = timeout_s
        shutil.rmtree(spool_dir, ignore_errors=True)  # a previous run's leftovers
        spool_dir.mkdir(parents=True, exist_ok=True)
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()  # one body at a time through the child
        self._waiting = threading.BoundedSemaphore(max_waiting)
        self.bounds = Bounds()

    def spool_path(self) -> Path:
        return self.spool_dir / f"{uuid.uuid4().hex}.json"

    def parse_file(
        self, path: Path, *, pack: bool, empty_ok: bool = True, decoder: str | None = None
    ) -> dict[str, Any]:
        """The JSON object in `path` (blocking: call it from a thread), or with `decoder`
        (`module:function`, see `trainer.serving.bodychild`) the dict it decodes the bytes
        into. With `pack`, the bulk arrays come back as numpy arrays. `BodyError` if refused."""
        if path.stat().st_size <= self.inline_max:
            return self.parse_bytes(path.read_bytes(), empty_ok=empty_ok, decoder=decoder)
        if not self._waiting.acquire(blocking=False):
            raise BodyError("busy", "too many large request bodies are being parsed; retry")
        try:
            with self._lock:
                request = {"pack": pack, "empty_ok": empty_ok, "decoder": decoder}
                return self._parse_in_child(path, request)
        finally:
            self._waiting.release()

    def parse_bytes(
        self, raw: bytes, *, empty_ok: bool = True, decoder: str | None = None
    ) -> dict[str, Any]:
        """A small body decoded in this process (blocking), within `bounds`."""
        if decoder is not None:
            return load_decoder(decoder)(raw, self.bounds)
        return decode_object(raw, empty_ok=empty_ok, bounds=self.bounds)

    def close(self) -> None:
        with self._lock:
            if self._proc is not None:
                self._stop_child()

    # -- the child ---------------------------------------------------------------------------

    def _child(self) -> subprocess.Popen[bytes]:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "trainer.serving.bodychild"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
        return self._proc

    def _stop_child(self) -> int:
        proc, self._proc = self._proc, None
        assert proc is not None
        if proc.poll() is None:
            proc.kill()
        code = proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()
        return code

    def _parse_in_child(self, path: Path, options: dict[str, Any]) -> dict[str, Any]:
        blob = self.spool_path().with_suffix(".bin")
        request = {"src": str(path), "blob": str(blob), "bounds": self.bounds.as_dict(), **options}
        try:
            line = self._exchange(json.dumps(request).encode() + b"\n")
            reply = _loads(line)
            if not reply["ok"]:
                raise BodyError(reply["kind"], reply["message"], reply.get("param"))
            return assemble(reply["skeleton"], reply["arrays"], blob)
        finally:
            blob.unlink(missing_ok=True)

    def _exchange(self, request: bytes) -> bytes:
        proc = self._child()
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(request)
            proc.stdin.flush()
            ready, _, _ = select.select([proc.stdout], [], [], self.timeout_s)
            line = proc.stdout.readline() if ready else None
        except (BrokenPipeError, OSError):
            line = b""
        if line is None:
            self._stop_child()
            raise BodyError("timeout", f"parsing the request body took over {self.timeout_s} s")
        if not line.endswith(b"\n"):  # the child died
            code = self._stop_child()
            if code == -signal.SIGKILL:
                raise BodyError("memory", "the request body is too large to parse in memory")
            log.error("the body parser exited with %s", code)
            raise BodyError("crash", f"the body parser failed (exit status {code})")
        return line


def _loads(text: bytes) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:  # NaN/Infinity or lone surrogates in a skeleton
        return json.loads(text)


def assemble(skeleton: dict[str, Any], arrays: dict[str, Any] | None, blob: Path) -> dict[str, Any]:
    """Put each packed array (a view of the blob, read once) where the child took it from."""
    if not arrays or not arrays["paths"]:
        return skeleton
    data = np.fromfile(blob, dtype=np.uint8)
    offset = 0
    for path, kind, count in zip(arrays["paths"], arrays["kinds"], arrays["counts"], strict=True):
        parts = json.loads(path)
        parent: Any = skeleton
        for part in parts[:-1]:
            parent = parent[part]
        dtype = KINDS[kind]
        size = dtype.itemsize * count
        parent[parts[-1]] = data[offset : offset + size].view(dtype.newbyteorder("="))
        offset += size + (-size % 8)
    return skeleton


# -- HTTP ------------------------------------------------------------------------------------


def too_large(limit: int, declared: str | None = None) -> ApiError:
    if declared is not None:
        message = (
            f"request body of {declared} bytes exceeds {limit}; large bodies go through "
            "payloads/upload-url (the SDK does this above 0.5 MiB)"
        )
    else:
        message = f"request body exceeds {limit} bytes"
    return ApiError(413, message, param="body", code="request_too_large")


def api_error(exc: BodyError, *, payload: bool = False) -> ApiError:
    """A refused body as the HTTP error: 400 naming the field, or 503/507/500."""
    if exc.kind == "invalid_json":
        if payload:
            return bad_request(
                f"payload_id: the uploaded payload is not JSON ({exc.message})", "payload_id"
            )
        return bad_request(f"request body is not valid JSON: {exc.message}", "body", "invalid_json")
    if exc.kind == "not_object":
        if payload:
            return bad_request(
                "payload_id: the uploaded payload is not a JSON object", "payload_id"
            )
        return bad_request("request body must be a JSON object", "body", "invalid_json")
    if exc.kind == "field":
        return bad_request(exc.message, exc.param)
    status, code = {
        "busy": (503, "service_unavailable"),
        "timeout": (503, "parse_timeout"),
        "memory": (507, "resource_exhausted"),
        "storage": (507, "insufficient_storage"),  # as `errors.disk_full`
    }.get(exc.kind, (500, "internal_error"))
    return ApiError(status, exc.message, param="body", code=code)


async def read_json(
    request: Request, limit: int, parser: BodyParser, *, pack: bool, decoder: str | None = None
) -> dict[str, Any]:
    """The request's JSON object (or what `decoder` makes of its bytes): decoded in a thread
    when small, spooled and parsed in the child when large (`pack`: an operation body, whose
    bulk arrays come back packed). Never held whole in memory as Python objects."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise too_large(limit, declared)
    chunks: list[bytes] = []
    size = 0
    stream: AsyncIterator[bytes] = request.stream()
    async for chunk in stream:
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
        if size > parser.inline_max:
            return await _spooled(chunks, size, stream, limit, parser, (pack, decoder))
    raw = b"".join(chunks)
    del chunks
    try:
        return await run_in_threadpool(parser.parse_bytes, raw, decoder=decoder)
    except BodyError as exc:
        raise api_error(exc) from None


async def _spooled(
    head: list[bytes],
    size: int,
    stream: AsyncIterator[bytes],
    limit: int,
    parser: BodyParser,
    how: tuple[bool, str | None],
) -> dict[str, Any]:
    path = parser.spool_path()
    try:
        handle: IO[bytes]
        with path.open("xb") as handle:
            handle.writelines(head)
            head.clear()
            async for chunk in stream:
                size += len(chunk)
                if size > limit:
                    raise too_large(limit)
                handle.write(chunk)
        return await run_in_threadpool(parser.parse_file, path, pack=how[0], decoder=how[1])
    except BodyError as exc:
        raise api_error(exc) from None
    except OSError as exc:
        if not is_disk_full(exc):
            raise
        raise api_error(BodyError("storage", f"spooling the body failed: {exc.strerror}")) from None
    finally:
        path.unlink(missing_ok=True)


def _array_digest(value: Any) -> Any:
    if isinstance(value, np.ndarray):  # hashlib releases the GIL on large buffers
        return {
            "array": value.dtype.str,
            "sha256": hashlib.sha256(np.ascontiguousarray(value).data).hexdigest(),
        }
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def body_hash(kind: str, body: dict[str, Any]) -> str:
    """Idempotency digest of an operation body: its canonical JSON (sorted keys), where each
    packed array stands as its dtype and the sha256 of its bytes (no 60 MB re-serialisation)."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), default=_array_digest)
    return hashlib.sha256(f"{kind}\n{canonical}".encode()).hexdigest()
