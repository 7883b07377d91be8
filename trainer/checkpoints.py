"""Checkpoint storage: atomic directories, a sha256 manifest, and a SQLite catalogue.

Layout under the storage root:

    checkpoints/<id>/manifest.json      {"files": {relpath: {"sha256", "size"}}, ...}
    checkpoints/<id>/...                the payload (safetensors + JSON only, never pickle)
    tmp/<id>.partial/                   a checkpoint being written (removed at start-up)
    catalog.sqlite                      one row per complete checkpoint

A checkpoint is written into `tmp/`, every file and the directory are fsynced, the manifest is
written last, the directory is renamed into `checkpoints/`, and only then is the catalogue row
inserted. A crash at any moment leaves either no trace (the partial directory is swept at the
next start) or a complete checkpoint. A directory without a catalogue row is adopted from its
manifest at start-up, so a crash between the rename and the insert loses nothing.
"""

from __future__ import annotations

import builtins
import concurrent.futures
import hashlib
import json
import os
import re
import shutil
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

TRAINING = "CHECKPOINT_TYPE_TRAINING"
INFERENCE = "CHECKPOINT_TYPE_INFERENCE"
VARIANT_DIRS = {"MERGED": "merged", "ADAPTER": "adapter"}
_ID = re.compile(r"^ckpt-[0-9a-f]{32}$")


class CheckpointCorrupt(Exception):
    """A file of a checkpoint is missing or does not match its manifest hash."""


@dataclass
class CheckpointRecord:
    id: str
    type: str
    session_id: str
    step: int
    base_model: str
    lora_rank: int | None
    created_at: float
    path: Path

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["path"] = str(self.path)
        return out


_BLOCK = 8 << 20


def sha256_file(path: Path) -> str:
    """sha256 of a file, read in large blocks into one reused buffer (hashlib drops the GIL)."""
    digest = hashlib.sha256()
    buf = bytearray(_BLOCK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            digest.update(view[:n])
    return digest.hexdigest()


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def seal_files(paths: list[Path]) -> dict[Path, str]:
    """fsync every file and compute its sha256, overlapped: a file's pages are hashed from the
    page cache while the kernel flushes them, and files proceed in parallel (hashlib and fsync
    both release the GIL). Returns path → sha256 once every file is durable.

    (Writing safetensors straight from tensor memory and hashing while writing was measured
    too, in `scripts/bench.py` row 6: within noise of this, so it was not kept.)
    """
    if not paths:
        return {}
    workers = min(8, 2 * len(paths))
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="seal") as pool:
        syncs = [pool.submit(_fsync_file, p) for p in paths]
        hashes = {p: pool.submit(sha256_file, p) for p in paths}
        for fut in syncs:
            fut.result()
        return {p: fut.result() for p, fut in hashes.items()}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True))


class CheckpointStore:
    """The catalogue and the files of all checkpoints under one storage root. Thread-safe."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.dir = self.root / "checkpoints"
        self.tmp = self.root / "tmp"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.tmp.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.root / "catalog.sqlite", check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS checkpoints (id TEXT PRIMARY KEY, type TEXT NOT NULL,"
            " session_id TEXT NOT NULL, step INTEGER NOT NULL, base_model TEXT NOT NULL,"
            " lora_rank INTEGER, created_at REAL NOT NULL, seq INTEGER NOT NULL)"
        )
        self._db.commit()
        self._recover()

    # -- writing ---------------------------------------------------------------------------

    def write(
        self,
        *,
        type: str,
        session_id: str,
        step: int,
        base_model: str,
        lora_rank: int | None,
        writer: Callable[[Path], None],
        meta: dict[str, Any] | None = None,
    ) -> CheckpointRecord:
        """Create a checkpoint atomically. `writer(dir)` fills a fresh directory with files."""
        if type not in (TRAINING, INFERENCE):
            raise ValueError(f"unknown checkpoint type {type}")
        checkpoint_id = f"ckpt-{uuid.uuid4().hex}"
        partial = self.tmp / f"{checkpoint_id}.partial"
        partial.mkdir()
        try:
            writer(partial)
            record = CheckpointRecord(
                id=checkpoint_id,
                type=type,
                session_id=session_id,
                step=step,
                base_model=base_model,
                lora_rank=lora_rank,
                created_at=time.time(),
                path=self.dir / checkpoint_id,
            )
            paths = sorted(p for p in partial.rglob("*") if p.is_file())
            digests = seal_files(paths)
            files = {
                path.relative_to(partial).as_posix(): {
                    "sha256": digests[path],
                    "size": path.stat().st_size,
                }
                for path in paths
            }
            for sub in sorted(p for p in partial.rglob("*") if p.is_dir()):
                _fsync_dir(sub)
            manifest = {"record": record.to_json(), "files": files, "meta": meta or {}}
            manifest["record"].pop("path")
            with open(partial / "manifest.json", "w") as fh:
                fh.write(json.dumps(manifest, indent=2, sort_keys=True))
                fh.flush()
                os.fsync(fh.fileno())
            _fsync_dir(partial)
            os.rename(partial, record.path)
            _fsync_dir(self.dir)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        self._insert(record)
        return record

    def _insert(self, record: CheckpointRecord) -> None:
        with self._lock:
            (seq,) = self._db.execute(
                "SELECT COALESCE(MAX(seq), 0) + 1 FROM checkpoints"
            ).fetchone()
            self._db.execute(
                "INSERT OR IGNORE INTO checkpoints VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    record.id,
                    record.type,
                    record.session_id,
                    record.step,
                    record.base_model,
                    record.lora_rank,
                    record.created_at,
                    seq,
                ),
            )
            self._db.commit()

    def _recover(self) -> None:
        """Sweep partial writes; adopt complete directories the catalogue does not know."""
        for leftover in self.tmp.iterdir():
            shutil.rmtree(leftover, ignore_errors=True)
        known = {row[0] for row in self._db.execute("SELECT id FROM checkpoints")}
        for path in sorted(self.dir.iterdir()):
            if path.name in known or not _ID.match(path.name):
                continue
            manifest = path / "manifest.json"
            if not manifest.exists():
                shutil.rmtree(path, ignore_errors=True)
                continue
            rec = json.loads(manifest.read_text())["record"]
            self._insert(CheckpointRecord(**rec, path=path))
        for checkpoint_id in known:
            if not (self.dir / checkpoint_id / "manifest.json").exists():
                with self._lock:
                    self._db.execute("DELETE FROM checkpoints WHERE id = ?", (checkpoint_id,))
                    self._db.commit()

    # -- reading ---------------------------------------------------------------------------

    def get(self, checkpoint_id: str) -> CheckpointRecord | None:
        if not _ID.match(checkpoint_id):
            return None
        with self._lock:
            row = self._db.execute(
                "SELECT * FROM checkpoints WHERE id = ?", (checkpoint_id,)
            ).fetchone()
        return self._record(row) if row else None

    def list(
        self,
        *,
        session_id: str | None = None,
        type: str | None = None,
        base_model: str | None = None,
        after: str | None = None,
        limit: int = 20,
    ) -> builtins.list[CheckpointRecord]:
        """Oldest first; `after` is the id of the last checkpoint of the previous page."""
        query = "SELECT * FROM checkpoints WHERE 1=1"
        args: list[Any] = []
        for column, value in (
            ("session_id", session_id),
            ("type", type),
            ("base_model", base_model),
        ):
            if value is not None:
                query += f" AND {column} = ?"
                args.append(value)
        if after is not None:
            query += " AND seq > COALESCE((SELECT seq FROM checkpoints WHERE id = ?), -1)"
            args.append(after)
        query += " ORDER BY seq LIMIT ?"
        args.append(limit)
        with self._lock:
            rows = self._db.execute(query, args).fetchall()
        return [self._record(row) for row in rows]

    def _record(self, row: tuple[Any, ...]) -> CheckpointRecord:
        checkpoint_id, type_, session_id, step, base_model, lora_rank, created_at, _ = row
        return CheckpointRecord(
            id=checkpoint_id,
            type=type_,
            session_id=session_id,
            step=step,
            base_model=base_model,
            lora_rank=lora_rank,
            created_at=created_at,
            path=self.dir / checkpoint_id,
        )

    def manifest(self, checkpoint_id: str) -> dict[str, Any]:
        record = self.get(checkpoint_id)
        if record is None:
            raise KeyError(checkpoint_id)
        return json.loads((record.path / "manifest.json").read_text())

    def open(self, checkpoint_id: str) -> tuple[CheckpointRecord, dict[str, Any]]:
        """The record and manifest of a checkpoint, after checking every file's sha256."""
        record = self.get(checkpoint_id)
        if record is None:
            raise KeyError(checkpoint_id)
        manifest = self.manifest(checkpoint_id)
        for rel, info in manifest["files"].items():
            path = record.path / rel
            if not path.is_file() or sha256_file(path) != info["sha256"]:
                raise CheckpointCorrupt(f"checkpoint {checkpoint_id}: {rel} fails its sha256")
        return record, manifest

    def files(self, checkpoint_id: str, variant: str) -> builtins.list[tuple[str, Path]]:
        """(filename within the variant, absolute path) for a download variant."""
        record = self.get(checkpoint_id)
        if record is None:
            raise KeyError(checkpoint_id)
        sub = VARIANT_DIRS.get(variant)
        base = record.path / sub if sub else None
        if base is None or not base.is_dir():
            raise KeyError(f"checkpoint {checkpoint_id} has no {variant} variant")
        return [
            (path.relative_to(base).as_posix(), path)
            for path in sorted(base.rglob("*"))
            if path.is_file()
        ]

    def close(self) -> None:
        with self._lock:
            self._db.close()
