"""Large-payload offload (docs/semantics.md §9): JSON bodies and results stored as files per
session.

The SDK uploads a request body over 0.5 MiB to a signed upload URL and sends `payload_id` in a
shrunk inline body; the server reads the real body back here. Results too large to answer
inline are written here and returned as `payload_id`, which the SDK downloads and merges.

Every write goes to its own temporary file, renamed into place once complete: concurrent or
retried PUTs to one upload URL never mix (the last complete upload wins), and a write that
fails (full disk, too large, cut off) leaves nothing behind. Files are deleted when their
session stops, and no write lands after that; at start-up (no session is live then) whatever
the last run left is swept.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi.concurrency import run_in_threadpool

from trainer.contract.errors import OperationError
from trainer.serving.bodies import BodyParser, api_error
from trainer.serving.errors import ApiError, bad_request, failed_precondition, is_disk_full
from trainer.serving.jsonparse import BodyError

_ID = re.compile(r"^pl_[0-9a-f]{32}$")


class PayloadFiles:
    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self._lock = threading.Lock()  # orders renames into a session's directory vs its drop
        self._dropped: set[str] = set()
        self.parser = BodyParser(root.parent / "bodies")  # spooled bodies, parsed off the GIL
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.iterdir():  # no session is live at start-up: all of it is stale
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)

    def session_bytes(self, session_id: str) -> int:
        """Bytes of the session's stored payloads."""
        directory = self.root / session_id
        if not directory.is_dir():
            return 0
        return sum(f.stat().st_size for f in directory.glob("*.json") if f.is_file())

    def new_id(self) -> str:
        return f"pl_{uuid.uuid4().hex}"

    def path(self, session_id: str, payload_id: str) -> Path:
        if not _ID.match(payload_id):
            raise bad_request(f"payload_id: malformed id {payload_id!r}", "payload_id")
        return self.root / session_id / f"{payload_id}.json"

    def _refuse_if_dropped(self, session_id: str) -> None:
        if session_id in self._dropped:
            raise failed_precondition(
                f"session_id: session {session_id} has stopped; its payloads are gone",
                "session_id",
            )

    def _open_partial(self, session_id: str, target: Path) -> tuple[Path, Any]:
        """A temporary file of this write alone, next to `target` (same filesystem)."""
        with self._lock:
            self._refuse_if_dropped(session_id)
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(f"{target.stem}.{uuid.uuid4().hex}.part")
            return partial, partial.open("xb")

    def _commit(self, session_id: str, partial: Path, target: Path) -> None:
        with self._lock:
            self._refuse_if_dropped(session_id)
            os.replace(partial, target)

    async def write_stream(
        self, session_id: str, payload_id: str, chunks: AsyncIterator[bytes]
    ) -> int:
        """Stream an upload to disk (atomically renamed into place); 413 past `max_bytes`."""
        target = self.path(session_id, payload_id)
        partial, handle = self._open_partial(session_id, target)
        size = 0
        try:
            with handle:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise ApiError(
                            413,
                            f"payload exceeds {self.max_bytes} bytes",
                            code="payload_too_large",
                        )
                    handle.write(chunk)
                handle.flush()
                await run_in_threadpool(os.fsync, handle.fileno())  # not on the event loop
            self._commit(session_id, partial, target)
        finally:
            partial.unlink(missing_ok=True)  # a failed or refused write leaves nothing
        return size

    def write_json(self, session_id: str, value: dict[str, Any]) -> str:
        payload_id = self.new_id()
        target = self.path(session_id, payload_id)
        partial, handle = self._open_partial(session_id, target)
        try:
            with handle:
                handle.write(json.dumps(value, separators=(",", ":")).encode())
                handle.flush()
                os.fsync(handle.fileno())  # on disk before the catalogue points at it
            self._commit(session_id, partial, target)
        finally:
            partial.unlink(missing_ok=True)
        return payload_id

    def read_json(self, session_id: str, payload_id: str) -> dict[str, Any]:
        target = self.path(session_id, payload_id)
        if not target.is_file():
            raise bad_request(
                f"payload_id: no uploaded payload {payload_id!r} for this session", "payload_id"
            )
        try:  # large payloads parse in the body parser's child process, arrays packed
            return self.parser.parse_file(target, pack=True, empty_ok=False)
        except FileNotFoundError:  # the session stopped meanwhile
            raise bad_request(
                f"payload_id: no uploaded payload {payload_id!r} for this session", "payload_id"
            ) from None
        except BodyError as exc:
            if exc.kind == "missing":
                raise bad_request(
                    f"payload_id: no uploaded payload {payload_id!r} for this session",
                    "payload_id",
                ) from None
            raise api_error(exc, payload=True) from None

    def drop_session(self, session_id: str) -> None:
        """Delete the session's payloads; later writes for it are refused, never recreated."""
        with self._lock:
            self._dropped.add(session_id)
            shutil.rmtree(self.root / session_id, ignore_errors=True)


def offload_result(
    store: PayloadFiles, session_id: str, output: dict[str, Any], limit: int
) -> dict[str, Any]:
    """Keep `loss` and `metrics` inline; move the rest to a payload when the output is large."""
    if len(json.dumps(output, separators=(",", ":"))) <= limit:
        return output
    inline = {k: v for k, v in output.items() if k in ("loss", "metrics", "step")}
    heavy = {k: v for k, v in output.items() if k not in inline}
    if not heavy:
        return output
    try:
        payload_id = store.write_json(session_id, heavy)
    except OSError as exc:
        if not is_disk_full(exc):
            raise
        raise OperationError(
            "RESOURCE_EXHAUSTED", f"storing the result failed: {exc.strerror}"
        ) from None
    return {**inline, "payload_id": payload_id}
