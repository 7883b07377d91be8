"""`<storage>/audit.jsonl`: one JSON line per mutating call, appended, rotated by size.

Each line is an object with a sequence number `seq` (1, 2, ... over the worker's whole life:
it continues from the last line on disk after a restart) and what `trainer.api.audit` records.
Once the file would pass `max_bytes` it is renamed `audit.jsonl.1` (the older ones shift to
`.2`, ... and the one past `keep` is deleted), and a new `audit.jsonl` starts.

Appends are serialised by a lock and written with one `write` of the whole line on a file
opened with O_APPEND, so concurrent requests never interleave lines. A write that fails (a full
disk, a read-only mount) is logged and dropped: the request it records has already been
answered, and the audit never turns it into an error. A line cut short by a crash is skipped
when reading.

Reading (`page`) goes newest first: from the end of `audit.jsonl` backwards, then through
`.1`, `.2`, ...; a page continues strictly before the `seq` its predecessor ended at.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FILE_NAME = "audit.jsonl"
_BLOCK = 64 * 1024


def _lines_backwards(path: Path) -> Iterator[bytes]:
    """The complete lines of a file, last first (a trailing partial line is skipped too)."""
    try:
        handle = path.open("rb")
    except FileNotFoundError:
        return
    with handle:
        end = handle.seek(0, os.SEEK_END)
        tail = b""
        while end > 0:
            start = max(0, end - _BLOCK)
            handle.seek(start)
            block = handle.read(end - start) + tail
            end = start
            lines = block.split(b"\n")
            tail = lines.pop(0)  # may continue in the previous block
            for line in reversed(lines):
                if line:
                    yield line
        if tail:
            yield tail


def _parse(line: bytes) -> dict[str, Any] | None:
    try:
        entry = json.loads(line)
    except ValueError:  # cut short by a crash, or not ours
        return None
    return entry if isinstance(entry, dict) and isinstance(entry.get("seq"), int) else None


class AuditLog:
    def __init__(self, storage: Path, max_bytes: int, keep: int) -> None:
        self.path = storage / FILE_NAME
        self.max_bytes = max_bytes
        self.keep = keep
        self._lock = threading.Lock()
        self._seq = self._last_seq()
        self.dropped = 0  # lines a failing write lost

    def _files(self) -> list[Path]:
        """Newest first: audit.jsonl, audit.jsonl.1, ..."""
        rotated = [self.path.with_name(f"{FILE_NAME}.{n}") for n in range(1, self.keep + 1)]
        return [self.path, *rotated]

    def _last_seq(self) -> int:
        for path in self._files():
            for line in _lines_backwards(path):
                entry = _parse(line)
                if entry is not None:
                    return int(entry["seq"])
        return 0

    def append(self, entry: dict[str, Any]) -> None:
        """Record `entry` (with its `seq` and `time` added); never raises on a storage error."""
        with self._lock:
            seq = self._seq + 1
            line = json.dumps({"seq": seq, "time": round(time.time(), 3), **entry}) + "\n"
            data = line.encode()
            try:
                self._rotate_for(len(data))
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                try:
                    written = os.write(fd, data)
                finally:
                    os.close(fd)
                if written != len(data):
                    raise OSError(f"short write ({written} of {len(data)} bytes)")
            except OSError as exc:
                self.dropped += 1
                log.error("audit: line %d not written (%s); %d lost", seq, exc, self.dropped)
                return
            self._seq = seq

    def _rotate_for(self, incoming: int) -> None:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return
        if size == 0 or size + incoming <= self.max_bytes:
            return
        files = self._files()
        files[-1].unlink(missing_ok=True)
        for older, newer in zip(reversed(files[1:]), reversed(files[:-1])):
            if newer.exists():
                newer.rename(older)

    def page(
        self, limit: int, before: int | None = None, user: str | None = None
    ) -> tuple[list[dict[str, Any]], bool]:
        """Up to `limit` entries, newest first, with `seq < before` (all when None) and of
        `user` (all when None); and whether older ones remain."""
        found: list[dict[str, Any]] = []
        for entry in self._entries_backwards():
            if before is not None and entry["seq"] >= before:
                continue
            if user is not None and entry.get("user") != user:
                continue
            if len(found) == limit:
                return found, True
            found.append(entry)
        return found, False

    def _entries_backwards(self) -> Iterator[dict[str, Any]]:
        last = None
        for path in self._files():
            for line in _lines_backwards(path):
                entry = _parse(line)
                # a rotation between two files' reads could show a line twice: seq only falls
                if entry is not None and (last is None or entry["seq"] < last):
                    last = entry["seq"]
                    yield entry
