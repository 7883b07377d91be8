"""The worker's own SQLite catalogue: model resources, sessions, operations and their keys.

Checkpoints live in the engine's `CheckpointStore`; this file records everything else that a
restart must not lose. Writes are autocommitted (WAL), so a crash loses at most the write in
flight. After a restart, `recover()` marks everything that was live as stopped: the models
are no longer loaded, but the records, and the checkpoints they point to, remain.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

_SCHEMA = """
CREATE TABLE IF NOT EXISTS resources (
    id TEXT PRIMARY KEY, spec TEXT NOT NULL, status TEXT NOT NULL, error TEXT,
    created_at REAL NOT NULL, updated_at REAL NOT NULL, expires_at REAL
);
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY, resource_id TEXT NOT NULL, spec TEXT NOT NULL, status TEXT NOT NULL,
    error TEXT, display_name TEXT, metadata TEXT NOT NULL, lora_config TEXT,
    step INTEGER NOT NULL, policy_state TEXT NOT NULL,
    created_at REAL NOT NULL, updated_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS sessions_by_resource ON sessions (resource_id);
CREATE TABLE IF NOT EXISTS operations (
    id TEXT PRIMARY KEY, session_id TEXT NOT NULL, kind TEXT NOT NULL,
    idem_key TEXT NOT NULL, body_hash TEXT NOT NULL, status TEXT NOT NULL,
    output TEXT, error TEXT, created_at REAL NOT NULL, updated_at REAL NOT NULL,
    UNIQUE (session_id, idem_key)
);
"""

# Columns added after the first release, to a table that lacks them (they default to NULL)
_ADDED_COLUMNS = (
    ("resources", "owner", "TEXT"),
    ("resources", "shared", "INTEGER NOT NULL DEFAULT 0"),
    ("sessions", "owner", "TEXT"),
    ("sessions", "internal", "INTEGER NOT NULL DEFAULT 0"),
)

# Wire enum spellings (SDK `types/post_training`).
RES_PENDING = "MODEL_RESOURCES_STATUS_PENDING"
RES_CREATING = "MODEL_RESOURCES_STATUS_CREATING"
RES_READY = "MODEL_RESOURCES_STATUS_READY"
RES_ERROR = "MODEL_RESOURCES_STATUS_ERROR"
RES_STOPPING = "MODEL_RESOURCES_STATUS_STOPPING"
RES_STOPPED = "MODEL_RESOURCES_STATUS_STOPPED"
RES_LIVE = (RES_PENDING, RES_CREATING, RES_READY, RES_STOPPING)

SES_CREATING = "TRAINING_SESSION_STATUS_CREATING"
SES_RUNNING = "TRAINING_SESSION_STATUS_RUNNING"
SES_STOPPING = "TRAINING_SESSION_STATUS_STOPPING"
SES_STOPPED = "TRAINING_SESSION_STATUS_STOPPED"
SES_ERROR = "TRAINING_SESSION_STATUS_ERROR"
SES_EXPIRED = "TRAINING_SESSION_STATUS_EXPIRED"
SES_LIVE = (SES_CREATING, SES_RUNNING, SES_STOPPING)

OP_PENDING = "TRAINING_OPERATION_STATUS_PENDING"
OP_RUNNING = "TRAINING_OPERATION_STATUS_RUNNING"
OP_COMPLETED = "TRAINING_OPERATION_STATUS_COMPLETED"
OP_FAILED = "TRAINING_OPERATION_STATUS_FAILED"

INITIAL_POLICY_STATE = {
    "trainer_step": 0,
    "target_weights_version": 0,
    "applied_weights_version": 0,
    "pending_publish": False,
}


@dataclass
class ResourceRow:
    id: str
    spec: dict[str, Any]
    status: str
    created_at: float
    updated_at: float
    error: dict[str, Any] | None = None
    expires_at: float | None = None
    owner: str | None = None  # the user who created it (None: before owners were recorded)
    shared: bool = False  # other users may open sessions on it (a LoRA resource)


@dataclass
class SessionRow:
    id: str
    resource_id: str
    spec: dict[str, Any]
    status: str
    created_at: float
    updated_at: float
    step: int = 0
    policy_state: dict[str, Any] = field(default_factory=lambda: dict(INITIAL_POLICY_STATE))
    metadata: dict[str, Any] = field(default_factory=dict)
    display_name: str | None = None
    lora_config: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    owner: str | None = None  # the user who opened it (None: before owners were recorded)
    internal: bool = False  # opened by the worker itself (a Tinker sampler's): no quota


@dataclass
class OperationRow:
    id: str
    session_id: str
    kind: str
    idem_key: str
    body_hash: str
    status: str
    created_at: float
    updated_at: float
    output: dict[str, Any] | None = None
    error: dict[str, Any] | None = None


Row = TypeVar("Row", ResourceRow, SessionRow, OperationRow)
_TABLES: dict[type[Any], str] = {
    ResourceRow: "resources",
    SessionRow: "sessions",
    OperationRow: "operations",
}


R = TypeVar("R")  # a dataclass record


@dataclass(frozen=True)
class RowCodec:
    """Dataclass records to and from SQLite rows: `json` fields as JSON text (None stays
    NULL), `bools` as 0 / 1."""

    json: frozenset[str]
    bools: frozenset[str] = frozenset()

    def encode(self, name: str, value: Any) -> Any:
        if value is None:
            return None
        if name in self.json:
            return json.dumps(value)
        return int(bool(value)) if name in self.bools else value

    def decode(self, cls: type[R], record: sqlite3.Row) -> R:
        values: dict[str, Any] = {}
        for f in fields(cls):  # type: ignore[arg-type]
            value = record[f.name]
            if f.name in self.json and value is not None:
                value = json.loads(value)
            elif f.name in self.bools:
                value = bool(value)
            values[f.name] = value
        return cls(**values)


_CODEC = RowCodec(
    json=frozenset({"spec", "error", "metadata", "lora_config", "policy_state", "output"}),
    bools=frozenset({"shared", "internal"}),
)


def open_db(
    path: Path, schema: str, added: tuple[tuple[str, str, str], ...] = ()
) -> sqlite3.Connection:
    """A SQLite database for one process's threads (the caller's lock serialises them):
    autocommit, WAL, rows by column name, `schema` applied, and each `(table, column, type)`
    of `added` added where a database from before that column lacks it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
    db.row_factory = sqlite3.Row
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.executescript(schema)
    for table, column, kind in added:
        if column not in {row["name"] for row in db.execute(f"PRAGMA table_info({table})")}:
            db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
    return db


class Catalogue:
    """Thread-safe: one connection, one lock; every write commits immediately."""

    def __init__(self, path: Path) -> None:
        self._lock = threading.Lock()
        self._db = open_db(path, _SCHEMA, _ADDED_COLUMNS)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- generic row access ----------------------------------------------------------------

    def insert(self, row: ResourceRow | SessionRow | OperationRow) -> None:
        table = _TABLES[type(row)]
        data = {k: _CODEC.encode(k, v) for k, v in asdict(row).items()}
        columns = ", ".join(data)
        marks = ", ".join("?" for _ in data)
        with self._lock:
            self._db.execute(
                f"INSERT INTO {table} ({columns}) VALUES ({marks})", list(data.values())
            )

    def update(self, cls: type[Row], ident: str, **changes: Any) -> None:
        changes.setdefault("updated_at", time.time())
        assignments = ", ".join(f"{k} = ?" for k in changes)
        values: list[Any] = [_CODEC.encode(k, v) for k, v in changes.items()]
        with self._lock:
            self._db.execute(
                f"UPDATE {_TABLES[cls]} SET {assignments} WHERE id = ?", [*values, ident]
            )

    def get(self, cls: type[Row], ident: str) -> Row | None:
        with self._lock:
            record = self._db.execute(
                f"SELECT * FROM {_TABLES[cls]} WHERE id = ?", (ident,)
            ).fetchone()
        return _CODEC.decode(cls, record) if record is not None else None

    def page(
        self,
        cls: type[Row],
        *,
        after: str | None,
        limit: int,
        where: dict[str, str] | None = None,
        statuses: list[str] | None = None,
    ) -> tuple[list[Row], bool]:
        """One page ordered by (created_at, id), starting after the row with id `after`.

        Returns the rows and whether more exist. An unknown `after` yields an empty page.
        """
        table = _TABLES[cls]
        clauses: list[str] = []
        params: list[Any] = []
        for column, value in (where or {}).items():
            clauses.append(f"{column} = ?")
            params.append(value)
        if statuses:
            clauses.append(f"status IN ({', '.join('?' for _ in statuses)})")
            params.extend(statuses)
        if after is not None:
            clauses.append(f"(created_at, id) > (SELECT created_at, id FROM {table} WHERE id = ?)")
            params.append(after)
        sql = f"SELECT * FROM {table}"
        if clauses:
            sql += " WHERE " + " AND ".join(clauses)
        sql += " ORDER BY created_at, id LIMIT ?"
        params.append(limit + 1)
        with self._lock:
            records = self._db.execute(sql, params).fetchall()
        rows = [_CODEC.decode(cls, r) for r in records[:limit]]
        return rows, len(records) > limit

    # -- specific queries ------------------------------------------------------------------

    def session_ids_of(self, owner: str) -> list[str]:
        """Every session `owner` opened (its checkpoints are the user's)."""
        with self._lock:
            rows = self._db.execute("SELECT id FROM sessions WHERE owner = ?", (owner,)).fetchall()
        return [str(r[0]) for r in rows]

    def count_live_owned(self, cls: type[ResourceRow] | type[SessionRow], owner: str) -> int:
        """Live resources (or live sessions the worker did not open for itself) of `owner`."""
        live: tuple[str, ...]
        if cls is ResourceRow:
            table, live, extra = "resources", RES_LIVE, ""
        else:
            table, live, extra = "sessions", SES_LIVE, " AND internal = 0"
        marks = ", ".join("?" for _ in live)
        with self._lock:
            row = self._db.execute(
                f"SELECT COUNT(*) FROM {table} WHERE owner = ? AND status IN ({marks}){extra}",
                (owner, *live),
            ).fetchone()
        return int(row[0])

    def sessions_of(self, resource_id: str) -> list[SessionRow]:
        with self._lock:
            records = self._db.execute(
                "SELECT * FROM sessions WHERE resource_id = ? ORDER BY created_at, id",
                (resource_id,),
            ).fetchall()
        return [_CODEC.decode(SessionRow, r) for r in records]

    def op_by_key(self, session_id: str, idem_key: str) -> OperationRow | None:
        with self._lock:
            record = self._db.execute(
                "SELECT * FROM operations WHERE session_id = ? AND idem_key = ?",
                (session_id, idem_key),
            ).fetchone()
        return _CODEC.decode(OperationRow, record) if record is not None else None

    def recover(self, now: float) -> None:
        """After a restart nothing is loaded: live resources and sessions become STOPPED, and
        operations that never finished become FAILED (the worker stopped under them)."""
        abandoned = json.dumps(
            {
                "code": "TRAINING_OPERATION_ERROR_CODE_SESSION_NOT_ACTIVE",
                "message": "the worker restarted before this operation finished",
            }
        )
        with self._lock:
            self._db.execute(
                f"UPDATE resources SET status = ?, updated_at = ?, expires_at = NULL "
                f"WHERE status IN ({', '.join('?' for _ in RES_LIVE)})",
                (RES_STOPPED, now, *RES_LIVE),
            )
            self._db.execute(
                f"UPDATE sessions SET status = ?, updated_at = ? "
                f"WHERE status IN ({', '.join('?' for _ in SES_LIVE)})",
                (SES_STOPPED, now, *SES_LIVE),
            )
            self._db.execute(
                "UPDATE operations SET status = ?, error = ?, updated_at = ? "
                "WHERE status IN (?, ?)",
                (OP_FAILED, abandoned, now, OP_PENDING, OP_RUNNING),
            )
