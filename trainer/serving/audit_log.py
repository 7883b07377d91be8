"""`<storage>/audit.jsonl`: one JSON line per mutating call, appended, rotated by size.

Each line is an object with a sequence number `seq` (1, 2, ... over the worker's whole life:
it continues from the last line on disk after a restart) and what `trainer.api.audit` records.
Once the file would pass `max_bytes` it is renamed `audit.jsonl.1` (the older ones shift to
`.2`, ... and the one past `keep` is deleted), and a new `audit.jsonl` starts.

Appends are serialised by a lock and written with one `write` of the whole line on a file
opened with O_APPEND, so concurrent requests never interleave lines. A line is written whole or
not at all: it is fsynced, and a short write (a full disk) is truncated back to where the line
began, so no fragment is left for the next line to be glued onto. A write that fails (a full
disk, a read-only mount) is logged and dropped: the request it records has already been
answered, and the audit never turns it into an error. A file that does not end with a newline
(a crash mid-write) gets one before the next line, so that line starts on its own.

Reading skips a damaged line (cut short by a crash, or not ours) and counts it (`damaged` of a
page, and a warning in the log); a complete line glued onto a fragment is still read.

Reading (`page`) goes newest first: from the end of `audit.jsonl` backwards, then through
`.1`, `.2`, ...; a page continues strictly before the `seq` its predecessor ended at.
"""

from __future__ import annotations

import contextlib
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


def _lines_backwards(path: Path) -> Iterator[tuple[int, bytes]]:
    """(offset, line) of the lines of a file, last first."""
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
            offset = start + len(tail) + 1
            starts = []
            for line in lines:
                starts.append(offset)
                offset += len(line) + 1
            for at, line in zip(reversed(starts), reversed(lines), strict=True):
                if line:
                    yield at, line
        if tail:
            yield 0, tail


_START = b'{"seq": '


def _parse_one(line: bytes) -> dict[str, Any] | None:
    try:
        entry = json.loads(line)
    except ValueError:  # cut short by a crash, or not ours
        return None
    return entry if isinstance(entry, dict) and isinstance(entry.get("seq"), int) else None


def _parse(line: bytes) -> tuple[dict[str, Any] | None, bool]:
    """(the entry of a line, whether the line was damaged). A line written after a fragment
    that a crash left (before lines were truncated back) is found at its own start."""
    entry = _parse_one(line)
    if entry is not None:
        return entry, False
    start = line.rfind(_START)
    return (_parse_one(line[start:]) if start > 0 else None), True


class AuditLog:
    def __init__(self, storage: Path, max_bytes: int, keep: int) -> None:
        self.path = storage / FILE_NAME
        self.max_bytes = max_bytes
        self.keep = keep
        self._lock = threading.Lock()
        self._seq = self._last_seq()
        self.dropped = 0  # lines a failing write lost
        self.reported: set[tuple[str, int]] = set()  # damaged lines already logged

    def _files(self) -> list[Path]:
        """Newest first: audit.jsonl, audit.jsonl.1, ..."""
        rotated = [self.path.with_name(f"{FILE_NAME}.{n}") for n in range(1, self.keep + 1)]
        return [self.path, *rotated]

    def _last_seq(self) -> int:
        for path in self._files():
            for _, line in _lines_backwards(path):
                entry, _ = _parse(line)
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
                _append_whole(self.path, data)
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
        entries, more, _ = self.page_report(limit, before, user)
        return entries, more

    def page_report(
        self, limit: int, before: int | None = None, user: str | None = None
    ) -> tuple[list[dict[str, Any]], bool, int]:
        """`page`, and how many damaged lines were skipped on the way."""
        found: list[dict[str, Any]] = []
        damaged = [0]
        for entry in self._entries_backwards(damaged):
            if before is not None and entry["seq"] >= before:
                continue
            if user is not None and entry.get("user") != user:
                continue
            if len(found) == limit:
                return found, True, damaged[0]
            found.append(entry)
        return found, False, damaged[0]

    def _entries_backwards(self, damaged: list[int]) -> Iterator[dict[str, Any]]:
        last = None
        for path in self._files():
            for offset, line in _lines_backwards(path):
                entry, broken = _parse(line)
                if broken:
                    damaged[0] += 1
                    self._report(path, offset, entry)
                # a rotation between two files' reads could show a line twice: seq only falls
                if entry is not None and (last is None or entry["seq"] < last):
                    last = entry["seq"]
                    yield entry

    def _report(self, path: Path, offset: int, recovered: dict[str, Any] | None) -> None:
        if (path.name, offset) in self.reported:
            return
        self.reported.add((path.name, offset))
        kept = f"; line {recovered['seq']} after it read" if recovered is not None else ""
        log.warning("audit: a damaged line at byte %d of %s skipped%s", offset, path.name, kept)


def _append_whole(path: Path, data: bytes) -> None:
    """Append `data` whole or not at all: fsynced; a short or failed write is truncated back
    to where it began (and raises). A file left without a final newline gets one first."""
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        start = os.fstat(fd).st_size
        if start and os.pread(fd, 1, start - 1) != b"\n":
            data = b"\n" + data  # a fragment a crash left stays a line of its own
        try:
            written = os.write(fd, data)
            if written != len(data):
                raise OSError(f"short write ({written} of {len(data)} bytes)")
            os.fsync(fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, start)
            raise
    finally:
        os.close(fd)
