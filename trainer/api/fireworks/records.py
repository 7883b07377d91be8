"""The Fireworks face's records, in `<storage>/fireworks.sqlite`: trainer jobs, the model
resources each job has held, the models promoted from their checkpoints, and deployments.

The engine's records (resources, sessions, checkpoints) stay in the worker's stores; these map
Fireworks names onto them. A restart keeps every row: a job whose resource the restart unloaded
reads as PAUSED (`trainer.api.fireworks.jobs`). Thread-safe: one connection, one lock, every
write committed at once.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from trainer.serving.catalogue import RowCodec, open_db


@dataclass
class JobRecord:
    account: str  # the user of the key that made it
    id: str
    base_model: str  # as the client named it (a catalogue name or a promoted model)
    lora_rank: int
    forward_only: bool
    state: str  # the last state written; `jobs.JobService.view` derives the live one
    created_at: float
    updated_at: float
    body: dict[str, Any] = field(default_factory=dict)  # what the create sent, echoed back
    resource_id: str | None = None  # the resource it holds (or last held)
    status: dict[str, Any] | None = None  # {code, message} of a failure or a pause
    completed_at: float | None = None


@dataclass
class HeldResource:
    account: str
    job_id: str
    resource_id: str
    started_at: float


@dataclass
class PromotedModel:
    account: str
    id: str
    checkpoint_id: str  # the engine's inference checkpoint it serves
    checkpoint_name: str  # its name among the job's (or training session's) checkpoints
    job_id: str  # the job's id, or `accounts/<a>/trainingSessions/<ts>` (a serverless session)
    base_model: str  # the catalogue entry its weights are of
    lora_rank: int  # 0: a merged full model; else a PEFT adapter of that rank
    created_at: float
    display_name: str | None = None


@dataclass
class DeploymentRecord:
    account: str
    id: str
    base_model: str  # as the client named it
    entry: str  # the catalogue entry it generates with
    state: str  # CREATING, READY or FAILED (`deployments`)
    created_at: float
    updated_at: float
    body: dict[str, Any] = field(default_factory=dict)  # the create body, patched since
    status: dict[str, Any] | None = None  # {code, message} of a failure
    identity: str | None = None  # the snapshot it serves (last hot-loaded); None: the base
    checkpoint_id: str | None = None  # the engine checkpoint of `identity`
    lora: bool = False  # whether that checkpoint is a LoRA adapter


def model_path(name: str) -> tuple[str, str] | None:
    """`(account, model id)` of a name shaped `accounts/<a>/models/<m>`; None otherwise."""
    parts = name.split("/")
    if len(parts) != 4 or parts[0] != "accounts" or parts[2] != "models":
        return None
    return parts[1], parts[3]


Record = TypeVar("Record", JobRecord, HeldResource, PromotedModel, DeploymentRecord)
_TABLES: dict[type[Any], str] = {
    JobRecord: "jobs",
    HeldResource: "held",
    PromotedModel: "models",
    DeploymentRecord: "deployments",
}
_CODEC = RowCodec(json=frozenset({"body", "status"}), bools=frozenset({"forward_only", "lora"}))
_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    account TEXT NOT NULL, id TEXT NOT NULL, base_model TEXT, lora_rank INTEGER,
    forward_only INTEGER, state TEXT, created_at REAL, updated_at REAL, body TEXT,
    resource_id TEXT, status TEXT, completed_at REAL, PRIMARY KEY (account, id));
CREATE TABLE IF NOT EXISTS held (
    account TEXT NOT NULL, job_id TEXT NOT NULL, resource_id TEXT PRIMARY KEY,
    started_at REAL);
CREATE INDEX IF NOT EXISTS held_by_job ON held (account, job_id);
CREATE TABLE IF NOT EXISTS models (
    account TEXT NOT NULL, id TEXT NOT NULL, checkpoint_id TEXT, checkpoint_name TEXT,
    job_id TEXT, base_model TEXT, lora_rank INTEGER, created_at REAL, display_name TEXT,
    PRIMARY KEY (account, id));
CREATE TABLE IF NOT EXISTS deployments (
    account TEXT NOT NULL, id TEXT NOT NULL, base_model TEXT, entry TEXT, state TEXT,
    created_at REAL, updated_at REAL, body TEXT, status TEXT, identity TEXT,
    checkpoint_id TEXT, lora INTEGER, PRIMARY KEY (account, id));
"""


class FireworksRecords:
    def __init__(self, path: Path) -> None:
        self._lock = threading.Lock()
        self._db = open_db(path, _SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def insert(self, record: Any) -> None:
        """Insert a row; `sqlite3.IntegrityError` when its key exists."""
        data = {k: _CODEC.encode(k, v) for k, v in asdict(record).items()}
        with self._lock:
            self._db.execute(
                f"INSERT INTO {_TABLES[type(record)]} ({', '.join(data)}) "
                f"VALUES ({', '.join('?' for _ in data)})",
                list(data.values()),
            )

    def update_job(self, account: str, job_id: str, **changes: Any) -> None:
        values = [_CODEC.encode(k, v) for k, v in changes.items()]
        with self._lock:
            self._db.execute(
                f"UPDATE jobs SET {', '.join(f'{k} = ?' for k in changes)} "
                "WHERE account = ? AND id = ?",
                [*values, account, job_id],
            )

    def delete_job(self, account: str, job_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM jobs WHERE account = ? AND id = ?", (account, job_id))
            self._db.execute("DELETE FROM held WHERE account = ? AND job_id = ?", (account, job_id))

    def update_deployment(self, account: str, deployment_id: str, **changes: Any) -> None:
        values = [_CODEC.encode(k, v) for k, v in changes.items()]
        with self._lock:
            self._db.execute(
                f"UPDATE deployments SET {', '.join(f'{k} = ?' for k in changes)} "
                "WHERE account = ? AND id = ?",
                [*values, account, deployment_id],
            )

    def delete_deployment(self, account: str, deployment_id: str) -> None:
        with self._lock:
            self._db.execute(
                "DELETE FROM deployments WHERE account = ? AND id = ?", (account, deployment_id)
            )

    def deployment(self, account: str, deployment_id: str) -> DeploymentRecord | None:
        found = self.select(DeploymentRecord, "account = ? AND id = ?", (account, deployment_id))
        return found[0] if found else None

    def select(
        self, cls: type[Record], where: str = "1", params: tuple[Any, ...] = (), tail: str = ""
    ) -> list[Record]:
        with self._lock:
            rows = self._db.execute(
                f"SELECT * FROM {_TABLES[cls]} WHERE {where} {tail}", params
            ).fetchall()
        return [_CODEC.decode(cls, r) for r in rows]

    def job(self, account: str, job_id: str) -> JobRecord | None:
        found = self.select(JobRecord, "account = ? AND id = ?", (account, job_id))
        return found[0] if found else None

    def model(self, account: str, model_id: str) -> PromotedModel | None:
        found = self.select(PromotedModel, "account = ? AND id = ?", (account, model_id))
        return found[0] if found else None

    def own_model(self, name: str, user: str) -> PromotedModel | None:
        """The model `name` (`accounts/<a>/models/<m>`) when it is promoted in `user`'s own
        account; None for any other name, another account's model included (it reads as a
        missing one)."""
        path = model_path(name)
        return self.model(user, path[1]) if path is not None and path[0] == user else None

    def held(self, account: str, job_id: str) -> list[HeldResource]:
        return self.select(
            HeldResource, "account = ? AND job_id = ?", (account, job_id), "ORDER BY started_at"
        )

    def job_of_resource(self, resource_id: str) -> HeldResource | None:
        found = self.select(HeldResource, "resource_id = ?", (resource_id,))
        return found[0] if found else None
