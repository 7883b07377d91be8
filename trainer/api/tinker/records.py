"""The Tinker face's own records, in `<storage>/tinker.sqlite`: sessions, models, futures,
checkpoint paths and sampling sessions.

The engine's records (resources, training sessions, operations, checkpoints) stay in the
worker's store; this one maps Tinker's names onto them:
- a Tinker model (`<session>:train:<seq>`, as the SDK derives it) -> the training session that
  currently holds it (a `load_state` moves it to a new one);
- a future (`request_id`) -> its status and translated result, so a retry of the same request
  (same `X-Idempotency-Key`) gets the same future and a restart keeps finished results;
- a `tinker://<run>/<weights|sampler_weights>/<name>` path -> the checkpoint id;
- a sampling session -> the checkpoint (or base model) it samples, and its owner.
Thread-safe: one connection, one lock, every write committed at once.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from trainer.serving.catalogue import RowCodec, open_db

PENDING, DONE, FAILED = "pending", "done", "failed"


@dataclass
class TinkerSession:
    id: str
    created_at: float
    heartbeat_at: float
    display_name: str | None = None
    user_metadata: dict[str, Any] = field(default_factory=dict)
    ended_at: float | None = None  # its heartbeats stopped: its models' sessions are closed
    owner: str | None = None  # the user who created it (None: before owners were recorded)


@dataclass
class TinkerModel:
    id: str  # `<tinker session>:train:<model_seq_id>`
    tinker_session: str
    base_model: str
    session_id: str  # the engine's training session now holding the model
    resource_id: str
    lora_rank: int
    created_at: float
    last_request_at: float
    lora_config: dict[str, Any] = field(default_factory=dict)
    user_metadata: dict[str, Any] = field(default_factory=dict)
    # a frozen reference (`base_only`, or a model of a forward-only job): forward only
    frozen: bool = False
    # the name space of its logical checkpoint names (`names.scope_of`): a gateway's job
    # (`Binding.scope`); None: the model's own
    scope: str | None = None


@dataclass
class TinkerFuture:
    id: str
    model_id: str  # a model, a sampling session or a Tinker session
    kind: str  # the SDK's request type: ForwardBackward, OptimStep, Sample, ...
    status: str
    created_at: float
    updated_at: float
    idem_key: str | None = None  # who sent it and what it asked (`identity.request_key`)
    result: dict[str, Any] | None = None
    error: str | None = None
    category: str | None = None  # "user" | "server"
    body_hash: str | None = None  # sha256 of the request's body: another body is a 409
    owner: str | None = None  # the user whose request made it


@dataclass
class TinkerCheckpoint:
    path: str  # tinker://<run>/<weights|sampler_weights>/<name>
    run_id: str
    kind: str  # "training" | "sampler"
    name: str
    checkpoint_id: str  # the engine's checkpoint
    created_at: float
    expires_at: float | None = None
    user_metadata: dict[str, Any] | None = None
    # a logical name's row (`names`: path `<account>/run-<32 hex>/<name>`): its name space;
    # None: a `tinker://` path
    scope: str | None = None
    # published (`routes_publish`): every user of the worker may read it; its owner alone
    # may change it
    public: bool = False
    # a sampler save with `checkpoint_type="merged_base"` (the Fireworks SDK): its LoRA
    # adapter folded into the base weights is what it promotes to (docs/semantics.md §22)
    merged: bool = False


@dataclass
class TinkerSampler:
    id: str
    tinker_session: str
    base_model: str
    created_at: float
    model_path: str | None = None
    checkpoint_id: str | None = None
    owner: str | None = None  # its Tinker session's owner, or the user of an ad-hoc sample


Record = TypeVar(
    "Record", TinkerSession, TinkerModel, TinkerFuture, TinkerCheckpoint, TinkerSampler
)
_TABLES: dict[type[Any], tuple[str, str]] = {
    TinkerSession: ("sessions", "id"),
    TinkerModel: ("models", "id"),
    TinkerFuture: ("futures", "id"),
    TinkerCheckpoint: ("checkpoints", "path"),
    TinkerSampler: ("samplers", "id"),
}
_CODEC = RowCodec(
    json=frozenset({"user_metadata", "lora_config", "result"}),
    bools=frozenset({"frozen", "public", "merged"}),
)
_ADDED_COLUMNS = (  # a store from before these columns existed gets them
    ("futures", "body_hash", "TEXT"),
    ("futures", "owner", "TEXT"),
    ("sessions", "owner", "TEXT"),
    ("samplers", "owner", "TEXT"),
    ("models", "frozen", "INTEGER NOT NULL DEFAULT 0"),
    ("models", "scope", "TEXT"),
    ("checkpoints", "scope", "TEXT"),
    ("checkpoints", "public", "INTEGER NOT NULL DEFAULT 0"),
    ("checkpoints", "merged", "INTEGER NOT NULL DEFAULT 0"),
)
_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY, created_at REAL, heartbeat_at REAL, display_name TEXT,
    user_metadata TEXT, ended_at REAL);
CREATE TABLE IF NOT EXISTS models (
    id TEXT PRIMARY KEY, tinker_session TEXT, base_model TEXT, session_id TEXT,
    resource_id TEXT, lora_rank INTEGER, created_at REAL, last_request_at REAL,
    lora_config TEXT, user_metadata TEXT);
CREATE TABLE IF NOT EXISTS futures (
    id TEXT PRIMARY KEY, model_id TEXT, kind TEXT, status TEXT, created_at REAL,
    updated_at REAL, idem_key TEXT UNIQUE, result TEXT, error TEXT, category TEXT,
    body_hash TEXT);
CREATE TABLE IF NOT EXISTS checkpoints (
    path TEXT PRIMARY KEY, run_id TEXT, kind TEXT, name TEXT, checkpoint_id TEXT,
    created_at REAL, expires_at REAL, user_metadata TEXT);
CREATE INDEX IF NOT EXISTS checkpoints_run ON checkpoints (run_id, created_at);
CREATE TABLE IF NOT EXISTS samplers (
    id TEXT PRIMARY KEY, tinker_session TEXT, base_model TEXT, created_at REAL,
    model_path TEXT, checkpoint_id TEXT);
"""


class TinkerRecords:
    def __init__(self, path: Path) -> None:
        self._lock = threading.Lock()
        self._db = open_db(path, _SCHEMA, _ADDED_COLUMNS)
        self._db.execute("CREATE INDEX IF NOT EXISTS checkpoints_scope ON checkpoints (scope)")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def insert(self, record: Any, replace: bool = False) -> None:
        table, _ = _TABLES[type(record)]
        data = {k: _sql(_CODEC.encode(k, v)) for k, v in asdict(record).items()}
        verb = "INSERT OR REPLACE" if replace else "INSERT"
        with self._lock:
            self._db.execute(
                f"{verb} INTO {table} ({', '.join(data)}) VALUES ({', '.join('?' for _ in data)})",
                list(data.values()),
            )

    def update(self, cls: type[Any], key: str, **changes: Any) -> None:
        table, pk = _TABLES[cls]
        values = [_sql(_CODEC.encode(k, v)) for k, v in changes.items()]
        with self._lock:
            self._db.execute(
                f"UPDATE {table} SET {', '.join(f'{k} = ?' for k in changes)} WHERE {pk} = ?",
                [*values, _sql(key)],
            )

    def get(self, cls: type[Record], key: str) -> Record | None:
        rows = self.select(cls, f"{_TABLES[cls][1]} = ?", (key,))
        return rows[0] if rows else None

    def select(
        self, cls: type[Record], where: str = "1", params: tuple[Any, ...] = (), tail: str = ""
    ) -> list[Record]:
        table, _ = _TABLES[cls]
        with self._lock:
            records = self._db.execute(
                f"SELECT * FROM {table} WHERE {where} {tail}", [_sql(p) for p in params]
            ).fetchall()
        return [_CODEC.decode(cls, r) for r in records]

    def count(self, cls: type[Any], where: str = "1", params: tuple[Any, ...] = ()) -> int:
        table, _ = _TABLES[cls]
        with self._lock:
            return int(
                self._db.execute(
                    f"SELECT COUNT(*) FROM {table} WHERE {where}", [_sql(p) for p in params]
                ).fetchone()[0]
            )

    def delete(self, cls: type[Any], key: str) -> None:
        table, pk = _TABLES[cls]
        with self._lock:
            self._db.execute(f"DELETE FROM {table} WHERE {pk} = ?", (_sql(key),))

    def future_by_key(self, idem_key: str) -> TinkerFuture | None:
        rows = self.select(TinkerFuture, "idem_key = ?", (idem_key,))
        return rows[0] if rows else None

    def prune(self, before: float) -> int:
        """Forget futures that settled before `before` (their results were there to fetch)."""
        with self._lock:
            cursor = self._db.execute(
                "DELETE FROM futures WHERE status != ? AND updated_at < ?", (PENDING, before)
            )
            return int(cursor.rowcount)

    def recover(self) -> int:
        """After a restart no engine session is live: futures still pending fail cleanly."""
        now = time.time()
        with self._lock:
            cursor = self._db.execute(
                "UPDATE futures SET status = ?, error = ?, category = ?, updated_at = ? "
                "WHERE status = ?",
                (
                    FAILED,
                    "the worker restarted before this request finished; its model must be "
                    "loaded again (load_state) before new requests",
                    "server",
                    now,
                    PENDING,
                ),
            )
            return int(cursor.rowcount)


def _sql(value: Any) -> Any:
    """A text value SQLite can bind: a client's string may hold lone surrogates (JSON allows
    `"\\ud800"`), which UTF-8 cannot encode; they are stored, and looked up, escaped."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return value.encode("utf-8", "backslashreplace").decode()
    return value
