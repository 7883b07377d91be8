"""Checkpoint storage: atomic directories, a sha256 manifest, and a SQLite catalogue.

Design notes: `docs/design/checkpoints.md`.
"""

from __future__ import annotations

import builtins
import json
import logging
import os
import re
import shutil
import sqlite3
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trainer.checkpoint.files import (
    ManifestFile,
    Sealer,
    VerifiedFiles,
    fsync_dir,
    manifest_files_of,
    save_tensors,
    seal_files,
    sealing,
    sha256_file,
)

__all__ = [
    "INFERENCE",
    "TRAINING",
    "CheckpointCorrupt",
    "CheckpointRecord",
    "CheckpointStore",
    "ManifestFile",
    "save_tensors",
    "seal_files",
    "sha256_file",
    "write_json",
]

log = logging.getLogger(__name__)

TRAINING = "CHECKPOINT_TYPE_TRAINING"
INFERENCE = "CHECKPOINT_TYPE_INFERENCE"
MERGED_DIR, ADAPTER_DIR = "merged", "adapter"  # an inference checkpoint's two variants
VARIANT_DIRS = {"MERGED": MERGED_DIR, "ADAPTER": ADAPTER_DIR}
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


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True))


def _manifest_record(manifest: dict[str, Any], path: Path) -> CheckpointRecord:
    """The catalogue record a manifest describes; ValueError if it is not well formed."""
    rec = manifest.get("record")
    if not isinstance(rec, dict):
        raise ValueError("manifest.json has no 'record' object")
    fields: dict[str, type | tuple[type, ...]] = {
        "id": str,
        "type": str,
        "session_id": str,
        "step": int,
        "base_model": str,
        "created_at": (int, float),
    }
    for name, kind in fields.items():
        if not isinstance(rec.get(name), kind) or isinstance(rec.get(name), bool):
            raise ValueError(f"manifest.json record has no valid {name!r}")
    rank = rec.get("lora_rank")
    if rank is not None and (type(rank) is not int):
        raise ValueError("manifest.json record has an invalid 'lora_rank'")
    if rec["id"] != path.name:
        raise ValueError(f"manifest.json names checkpoint {rec['id']!r}, not {path.name!r}")
    if rec["type"] not in (TRAINING, INFERENCE):
        raise ValueError(f"manifest.json has an unknown checkpoint type {rec['type']!r}")
    return CheckpointRecord(
        id=rec["id"],
        type=rec["type"],
        session_id=rec["session_id"],
        step=rec["step"],
        base_model=rec["base_model"],
        lora_rank=rank,
        created_at=float(rec["created_at"]),
        path=path,
    )


class CheckpointStore:
    """The catalogue and the files of all checkpoints under one storage root. Thread-safe."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.dir = self.root / "checkpoints"
        self.tmp = self.root / "tmp"
        self.quarantine = self.root / "quarantine"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.tmp.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._manifests: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._verified = VerifiedFiles()
        self._db = sqlite3.connect(self.root / "catalog.sqlite", check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS checkpoints (id TEXT PRIMARY KEY, type TEXT NOT NULL,"
            " session_id TEXT NOT NULL, step INTEGER NOT NULL, base_model TEXT NOT NULL,"
            " lora_rank INTEGER, created_at REAL NOT NULL, seq INTEGER NOT NULL)"
        )
        self._db.execute(
            "CREATE INDEX IF NOT EXISTS checkpoints_order ON checkpoints (created_at, id)"
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
        """Create a checkpoint atomically. `writer(dir)` fills a fresh directory with files;
        files it writes with `save_tensors` are fsynced and hashed while it goes on."""
        if type not in (TRAINING, INFERENCE):
            raise ValueError(f"unknown checkpoint type {type}")
        checkpoint_id = f"ckpt-{uuid.uuid4().hex}"
        partial = self.tmp / f"{checkpoint_id}.partial"
        partial.mkdir()
        sealer = Sealer()
        try:
            with sealing(sealer):
                writer(partial)
                paths = sorted(p for p in partial.rglob("*") if p.is_file())
                digests = seal_files(paths)
            row = (checkpoint_id, type, session_id, step, base_model, lora_rank, time.time())
            record = self._record(row)
            files = {
                path.relative_to(partial).as_posix(): {
                    "sha256": digests[path],
                    "size": path.stat().st_size,
                }
                for path in paths
            }
            for sub in sorted(p for p in partial.rglob("*") if p.is_dir()):
                fsync_dir(sub)
            manifest = {"record": record.to_json(), "files": files, "meta": meta or {}}
            manifest["record"].pop("path")
            with open(partial / "manifest.json", "w") as fh:
                fh.write(json.dumps(manifest, indent=2, sort_keys=True))
                fh.flush()
                os.fsync(fh.fileno())
            fsync_dir(partial)
            os.rename(partial, record.path)
            fsync_dir(self.dir)
        except BaseException:
            sealer.close()
            shutil.rmtree(partial, ignore_errors=True)
            raise
        sealer.close()
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

    # -- start-up --------------------------------------------------------------------------

    def _recover(self) -> None:
        """Sweep partial writes; adopt complete directories the catalogue does not know;
        quarantine damaged ones. Never raises for what it finds on disk."""
        for leftover in self.tmp.iterdir():
            if leftover.is_dir() and not leftover.is_symlink():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)
        known = {row[0] for row in self._db.execute("SELECT id FROM checkpoints")}
        for path in sorted(self.dir.iterdir()):
            if path.name in known or not _ID.match(path.name):
                continue
            try:
                record = self._adoptable(path)
            except (OSError, ValueError) as exc:
                self._quarantine(path, f"uncatalogued and not adoptable: {exc}")
                continue
            self._insert(record)
            log.info("adopted checkpoint %s from its manifest", path.name)
        for checkpoint_id in sorted(known):
            path = self.dir / checkpoint_id
            if (path / "manifest.json").is_file():
                continue
            with self._lock:
                self._db.execute("DELETE FROM checkpoints WHERE id = ?", (checkpoint_id,))
                self._db.commit()
            if path.exists():
                self._quarantine(path, "catalogued but has no manifest.json; unlisted")
            else:
                log.warning(
                    "checkpoint %s was catalogued but its directory is gone; unlisted",
                    checkpoint_id,
                )

    def _adoptable(self, path: Path) -> CheckpointRecord:
        """The record of an uncatalogued directory whose manifest is readable and whose files
        all exist with their listed sizes (hashes are checked when the files are read)."""
        if not path.is_dir() or path.is_symlink():
            raise ValueError("not a directory")
        try:
            manifest = json.loads((path / "manifest.json").read_text())
        except FileNotFoundError:
            raise ValueError("manifest.json is missing") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"manifest.json is not valid JSON ({exc})") from None
        files = manifest_files_of(manifest)
        record = _manifest_record(manifest, path)
        for rel, info in files.items():
            file = path / rel
            if not file.is_file():
                raise ValueError(f"{rel} is missing")
            if file.stat().st_size != info["size"]:
                raise ValueError(f"{rel} has {file.stat().st_size} bytes, manifest {info['size']}")
        return record

    def _quarantine(self, path: Path, reason: str) -> None:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        dest = self.quarantine / f"{path.name}-{stamp}-{uuid.uuid4().hex[:6]}"
        try:
            self.quarantine.mkdir(exist_ok=True)
            os.rename(path, dest)
            fsync_dir(self.dir)
            fsync_dir(self.quarantine)
        except OSError as exc:
            log.error(
                "checkpoint directory %s is damaged (%s) and could not be moved to %s: %s;"
                " left in place, not listed",
                path,
                reason,
                dest,
                exc,
            )
            return
        log.warning("checkpoint directory %s: %s; moved to %s", path.name, reason, dest)

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
        oldest_first: bool = False,
        session_ids: builtins.list[str] | None = None,
    ) -> builtins.list[CheckpointRecord]:
        """Newest first: `created_at` descending, ties broken by id (descending too).

        `after` is the id of the last checkpoint of the previous page; the page continues
        strictly past it in that order (a keyset on (created_at, id), not an offset), so
        checkpoints created between pages neither shift nor repeat items. An unknown `after`
        raises KeyError. `oldest_first` reverses the order (a session's own checkpoints);
        `session_ids` keeps the checkpoints of those sessions only."""
        clauses: builtins.list[str] = []
        args: builtins.list[Any] = []
        for column, value in (
            ("session_id", session_id),
            ("type", type),
            ("base_model", base_model),
        ):
            if value is not None:
                clauses.append(f"{column} = ?")
                args.append(value)
        if session_ids is not None:  # one of these sessions' (a user's: its sessions)
            if not session_ids:
                return []
            clauses.append(f"session_id IN ({', '.join('?' for _ in session_ids)})")
            args.extend(session_ids)
        direction = "ASC" if oldest_first else "DESC"
        with self._lock:
            if after is not None:
                cursor = self._db.execute(
                    "SELECT created_at, id FROM checkpoints WHERE id = ?", (after,)
                ).fetchone()
                if cursor is None:
                    raise KeyError(after)
                clauses.append(f"(created_at, id) {'>' if oldest_first else '<'} (?, ?)")
                args.extend(cursor)
            query = "SELECT * FROM checkpoints"
            if clauses:
                query += " WHERE " + " AND ".join(clauses)
            query += f" ORDER BY created_at {direction}, id {direction} LIMIT ?"
            rows = self._db.execute(query, [*args, limit]).fetchall()
        return [self._record(row) for row in rows]

    def _record(self, row: tuple[Any, ...]) -> CheckpointRecord:
        id_, type_, session_id, step, base_model, lora_rank, created_at = row[:7]
        path = self.dir / id_
        return CheckpointRecord(
            id_, type_, session_id, step, base_model, lora_rank, created_at, path
        )

    def manifest(self, checkpoint_id: str) -> dict[str, Any]:
        """The manifest of a catalogued checkpoint (read once, then remembered: manifests never
        change). KeyError if not catalogued, CheckpointCorrupt if unreadable or malformed."""
        record = self.get(checkpoint_id)
        if record is None:
            raise KeyError(checkpoint_id)
        with self._lock:
            cached = self._manifests.get(checkpoint_id)
        if cached is not None:
            return cached
        try:
            manifest = json.loads((record.path / "manifest.json").read_text())
            manifest_files_of(manifest)
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise CheckpointCorrupt(
                f"checkpoint {checkpoint_id}: manifest.json cannot be read ({exc})"
            ) from None
        with self._lock:
            self._manifests[checkpoint_id] = manifest
            while len(self._manifests) > 1024:
                self._manifests.popitem(last=False)
        return manifest

    def manifest_files(self, checkpoint_id: str) -> builtins.list[ManifestFile]:
        """Every file of a checkpoint per its manifest, sorted by path."""
        record = self.get(checkpoint_id)
        if record is None:
            raise KeyError(checkpoint_id)
        files = self.manifest(checkpoint_id)["files"]
        return [
            ManifestFile(rel, rel, record.path / rel, info["size"], info["sha256"])
            for rel, info in sorted(files.items())
        ]

    def verify(self, checkpoint_id: str, entry: ManifestFile) -> None:
        """Check one file against its manifest size and sha256 (remembered while the file is
        unchanged); CheckpointCorrupt names the checkpoint and the file."""
        problem = self._verified.matches(entry.path, entry.sha256, entry.size)
        if problem is not None:
            raise CheckpointCorrupt(f"checkpoint {checkpoint_id}: {entry.rel} {problem}")

    def open(self, checkpoint_id: str) -> tuple[CheckpointRecord, dict[str, Any]]:
        """The record and manifest of a checkpoint, after checking every file's sha256."""
        record = self.get(checkpoint_id)
        if record is None:
            raise KeyError(checkpoint_id)
        for entry in self.manifest_files(checkpoint_id):
            self.verify(checkpoint_id, entry)
        return record, self.manifest(checkpoint_id)

    def variant_files(
        self, checkpoint_id: str, variant: str, *, check: bool = True
    ) -> builtins.list[ManifestFile]:
        """The files of a download variant ("MERGED" or "ADAPTER"), from the manifest: a file
        deleted from disk is an error, never an omission. KeyError if the checkpoint or the
        variant does not exist; with `check`, CheckpointCorrupt if a file is missing or has
        the wrong size (hashes: `verify`)."""
        sub = VARIANT_DIRS.get(variant)
        if sub is None:
            raise KeyError(f"unknown variant {variant}")
        prefix = f"{sub}/"
        out = [
            ManifestFile(e.rel[len(prefix) :], e.rel, e.path, e.size, e.sha256)
            for e in self.manifest_files(checkpoint_id)
            if e.rel.startswith(prefix)
        ]
        if not out:
            raise KeyError(f"checkpoint {checkpoint_id} has no {variant} variant")
        for entry in out if check else ():
            try:
                size = entry.path.stat().st_size if entry.path.is_file() else None
            except OSError:
                size = None
            if size is None:
                raise CheckpointCorrupt(f"checkpoint {checkpoint_id}: {entry.rel} is missing")
            if size != entry.size:
                raise CheckpointCorrupt(
                    f"checkpoint {checkpoint_id}: {entry.rel} has {size} bytes, "
                    f"its manifest says {entry.size}"
                )
        return out

    def files(self, checkpoint_id: str, variant: str) -> builtins.list[tuple[str, Path]]:
        """(filename within the variant, absolute path) for a download variant."""
        return [(e.name, e.path) for e in self.variant_files(checkpoint_id, variant)]

    def delete(self, checkpoint_id: str) -> bool:
        """Remove a checkpoint, its row and its files; False if it is not catalogued. Its
        directory moves under `tmp/` first (one rename), so it is never listed half gone: a
        crash after the rename leaves a row without a directory, which the next start unlists,
        and a leftover in `tmp/`, which it sweeps."""
        record = self.get(checkpoint_id)
        if record is None:
            return False
        doomed = self.tmp / f"{checkpoint_id}.deleted"
        if record.path.exists():
            os.rename(record.path, doomed)
            fsync_dir(self.dir)
        with self._lock:
            self._db.execute("DELETE FROM checkpoints WHERE id = ?", (checkpoint_id,))
            self._db.commit()
            self._manifests.pop(checkpoint_id, None)
        shutil.rmtree(doomed, ignore_errors=True)
        return True

    def close(self) -> None:
        with self._lock:
            self._db.close()
