"""The command stream: rank 0's proxies (`DistributedResource`, `DistributedSession`) send
each call as JSON to every rank, every rank executes it (`Executor`), and all ranks settle the
outcome together; ranks other than 0 loop in `run_worker`."""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast, get_type_hints

from pydantic import TypeAdapter

from trainer.checkpoint.export import is_encrypted
from trainer.checkpoint.store import CheckpointCorrupt, CheckpointRecord, CheckpointStore
from trainer.contract.errors import OperationError
from trainer.contract.options import EngineOptions
from trainer.contract.specs import LoraConfig, ModelEntry, ResourceSpec, SessionSpec
from trainer.distributed.batching import PASS_GROUP_OP, DistributedBatcher, run_group
from trainer.distributed.comm import Comm
from trainer.distributed.follower_checkpoints import FollowerCheckpoints
from trainer.distributed.sharding import Sharded
from trainer.engine.batching.work import WorkItem
from trainer.engine.faults import fault_point
from trainer.engine.resource import ModelResource
from trainer.engine.session import TrainingSession

log = logging.getLogger(__name__)
_ADAPTERS: dict[Callable[..., Any], dict[str, TypeAdapter[Any]]] = {}


# the session methods every rank runs (the operations a client queues)
SESSION_METHODS = frozenset(TrainingSession.OPERATIONS)
# arguments of rank 0's caller that no other rank can have: a sharded session drops them (a
# sample's `watch`: its stream arrives whole and a client that leaves does not stop it, since
# every rank must run the same decode steps)
LOCAL_ONLY = frozenset({"watch"})


def _adapters(method: Callable[..., Any]) -> dict[str, TypeAdapter[Any]]:
    """One JSON codec per parameter of an engine method, from its own annotations."""
    func = getattr(method, "__func__", method)
    adapters = _ADAPTERS.get(func)
    if adapters is None:
        hints = get_type_hints(func)
        names = [
            n for n in inspect.signature(func).parameters if n != "self" and n not in LOCAL_ONLY
        ]
        adapters = {n: TypeAdapter(hints.get(n, Any)) for n in names}
        _ADAPTERS[func] = adapters
    return adapters


def encode_args(method: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """A call's arguments as JSON, by parameter name (rank 0, before the broadcast)."""
    bound = inspect.signature(method).bind(*args, **kwargs)
    adapters = _adapters(method)
    return {n: adapters[n].dump_python(v, mode="json") for n, v in bound.arguments.items()}


def decode_args(method: Callable[..., Any], args: dict[str, Any]) -> dict[str, Any]:
    """The typed keyword arguments back from `encode_args`'s JSON (every rank)."""
    adapters = _adapters(method)
    return {n: adapters[n].validate_python(v) for n, v in args.items()}


def _session_op(session: TrainingSession, op: str, args: dict[str, Any]) -> Any:
    """Every rank: the operation table's engine method `op`, called with the decoded args."""
    if op not in SESSION_METHODS:
        raise ValueError(f"unknown session operation {op!r}")
    method = getattr(session, op)
    return method(**decode_args(method, args))


def _work_item(session: TrainingSession, op: str, args: dict[str, Any]) -> WorkItem:
    """Every rank: the work item of pass operation `op`, from its JSON args, not run yet."""
    if op not in TrainingSession.PASS_OPERATIONS:
        raise ValueError(f"{op!r} is not a pass operation")
    return session.work_item(op, decode_args(getattr(session, op), args))


class Executor:
    """Runs commands on this rank's replica of the engine objects."""

    def __init__(self, comm: Comm, options: EngineOptions | None, cpu_offload: bool) -> None:
        self.comm = comm
        self.options = options
        self.cpu_offload = cpu_offload
        self.resources: dict[str, ModelResource] = {}
        self.follower_checkpoints = FollowerCheckpoints()

    def run(self, command: dict[str, Any], store: CheckpointStore | None = None) -> Any:
        op = command["op"]
        fault_point(op)
        if op == "load_resource":
            for record in command.get("checkpoints", []):  # a verified `base_weights_ref`
                self.follower_checkpoints.known[record["id"]] = _record_from_json(record)
            resource = ModelResource(
                ModelEntry.model_validate(command["entry"]),
                ResourceSpec.model_validate(command["spec"]),
                store if store is not None else cast(CheckpointStore, self.follower_checkpoints),
                options=self.options,
                placement=Sharded(self.comm, self.cpu_offload),
            )
            self.resources[command["resource"]] = resource
            return resource
        resource = self.resources[command["resource"]]
        if op == "close_resource":
            self.resources.pop(command["resource"]).close()
            return None
        if op == "create_session":
            for record in command.get("checkpoints", []):
                self.follower_checkpoints.known[record["id"]] = _record_from_json(record)
            return resource.create_session(
                command["session"], SessionSpec.model_validate(command["spec"])
            )
        if op == "close_session":
            resource.close_session(command["session"])
            return None
        if op == PASS_GROUP_OP:  # several sessions' calls, in shared passes (`batching.py`)
            return run_group(resource, command["calls"], _work_item)
        session = resource.sessions[command["session"]]
        return _session_op(session, op, command["args"])


def _record_from_json(data: dict[str, Any]) -> CheckpointRecord:
    return CheckpointRecord(**{**data, "path": Path(data["path"])})


def _verdict(outcomes: list[dict[str, Any]]) -> str:
    """`ok`: every rank succeeded. `failed`: every rank raised an `OperationError`; those are
    raised where all ranks are in step (validation before any collective, or the global checks
    after them) and leave each rank's state untouched, so the replicas still agree. `broken`:
    anything else (some ranks only, or an unexpected exception that may have left the ranks'
    collectives out of step)."""
    if all(o["ok"] for o in outcomes):
        return "ok"
    if all(not o["ok"] and o["code"] is not None for o in outcomes):
        return "failed"
    return "broken"


def _describe(exc: BaseException) -> dict[str, Any]:
    code = exc.code if isinstance(exc, OperationError) else None
    return {"ok": False, "type": type(exc).__name__, "message": str(exc), "code": code}


class Spmd:
    """The command stream of the job: rank 0 issues commands, every rank executes them."""

    def __init__(
        self,
        comm: Comm,
        options: EngineOptions | None = None,
        cpu_offload: bool = False,
        on_broken: Callable[[str], None] | None = None,
    ) -> None:
        self.comm = comm
        self.executor = Executor(comm, options, cpu_offload)
        self.lock = threading.Lock()
        self.broken: str | None = None
        self.on_broken = on_broken

    def _break(self, reason: str) -> OperationError:
        self.broken = reason
        log.error("distributed worker group is broken: %s", reason)
        if self.on_broken is not None:
            self.on_broken(reason)
        return OperationError("INTERNAL_ERROR", reason)

    def _execute(self, command: dict[str, Any], store: Any = None) -> tuple[Any, Any, Any]:
        """(outcome for the exchange, result, exception)."""
        try:
            return {"ok": True}, self.executor.run(command, store), None
        except Exception as exc:
            if self.comm.rank != 0:
                log.warning("rank %d: %s failed: %r", self.comm.rank, command["op"], exc)
            return _describe(exc), None, exc

    def call(self, command: dict[str, Any], store: Any = None) -> Any:
        """Rank 0: broadcast, execute here too, then settle with every rank's outcome."""
        op = command["op"]
        with self.lock:
            if self.broken is not None:
                raise OperationError(
                    "INTERNAL_ERROR", f"the distributed worker group is broken ({self.broken})"
                )
            try:
                self.comm.broadcast_json(command, group=self.comm.commands)
            except Exception as exc:
                raise self._break(f"rank 0 could not send {op}: {exc}") from None
            outcome, result, error = self._execute(command, store)
            try:
                outcomes = self.comm.all_gather_json(outcome, group=self.comm.outcomes)
            except Exception as exc:
                first = f"rank 0: {type(error).__name__}: {error}; " if error else ""
                raise self._break(
                    f"{op} failed: {first}a peer rank is dead or stuck "
                    f"(collective failed or timed out: {exc})"
                ) from None
            verdict = _verdict(outcomes)
            if verdict == "ok":
                return result
            if verdict == "failed" and isinstance(error, OperationError):
                raise error
            failed = [(r, o) for r, o in enumerate(outcomes) if not o["ok"]]
            details = "; ".join(f"rank {r}: {o['type']}: {o['message']}" for r, o in failed)
            raise self._break(f"{op} failed ({details})")

    def serve(self) -> int:
        """Ranks ≠ 0: execute commands until `shutdown` (0) or a broken group (1)."""
        while True:
            try:
                command = self.comm.broadcast_json(group=self.comm.commands)
            except Exception as exc:
                log.error("rank %d: lost rank 0 (%s); exiting", self.comm.rank, exc)
                return 1
            if command["op"] == "shutdown":
                return 0
            outcome, _, _ = self._execute(command)
            try:
                outcomes = self.comm.all_gather_json(outcome, group=self.comm.outcomes)
            except Exception as exc:
                log.error("rank %d: %s: a peer is gone (%s)", self.comm.rank, command["op"], exc)
                return 1
            if _verdict(outcomes) == "broken":
                log.error("rank %d: %s broke the group %s", self.comm.rank, command["op"], outcomes)
                return 1

    def shutdown(self) -> None:
        """Rank 0: release the workers (they return 0 from `run_worker`)."""
        with self.lock:
            if self.broken is None:
                with contextlib.suppress(Exception):
                    self.comm.broadcast_json({"op": "shutdown"}, group=self.comm.commands)
            self.broken = "shut down"


def run_worker(spmd: Spmd) -> int:
    """The loop of ranks ≠ 0; returns the process exit code."""
    if spmd.comm.rank == 0:
        raise ValueError("rank 0 issues commands; run_worker is for the other ranks")
    return spmd.serve()


class DistributedSession:
    """Rank 0's stand-in for a `TrainingSession`: each operation runs on every rank."""

    def __init__(
        self,
        spmd: Spmd,
        resource_id: str,
        local: TrainingSession,
        batcher: DistributedBatcher | None = None,
    ) -> None:
        self._spmd = spmd
        self._resource_id = resource_id
        self.local = local
        self.id = local.id
        self._batcher = batcher

    def _forward(self, op: str, *args: Any, **kwargs: Any) -> Any:
        """Run the session method `op` on every rank; rank 0's result. A call that may share
        a pass goes with other sessions' concurrent calls (`batching.py`)."""
        for name in LOCAL_ONLY:
            kwargs.pop(name, None)
        encoded = encode_args(getattr(self.local, op), *args, **kwargs)
        if self._batcher is not None and self._batcher.wants(self.local, op):
            window = self.local.options.merge_window_ms
            return self._batcher.run(self.id, op, encoded, window)
        command = {"op": op, "resource": self._resource_id, "session": self.id, "args": encoded}
        return self._spmd.call(command)

    @property
    def step(self) -> int:
        return self.local.step

    @property
    def lora_config(self) -> LoraConfig | None:
        return self.local.lora_config

    def policy_state(self) -> dict[str, Any]:
        return self.local.policy_state()

    def __getattr__(self, name: str) -> Any:
        """The operation table's methods run on every rank; the rest (spec, active,
        training_checkpoints, ...) read rank 0's session."""
        if name in SESSION_METHODS:
            return functools.partial(self._forward, name)
        return getattr(self.local, name)


class DistributedResource:
    """Rank 0's stand-in for a `ModelResource`, loaded and used on every rank."""

    def __init__(
        self, spmd: Spmd, entry: ModelEntry, spec: ResourceSpec, store: CheckpointStore
    ) -> None:
        self._spmd = spmd
        self.id = f"r-{uuid.uuid4().hex}"
        command: dict[str, Any] = {
            "op": "load_resource",
            "resource": self.id,
            "entry": entry.model_dump(mode="json"),
            "spec": spec.model_dump(mode="json"),
            "checkpoints": [],
        }
        if spec.base_weights_ref:  # the other ranks read the merged model rank 0 verified
            with contextlib.suppress(KeyError, CheckpointCorrupt):
                record, _ = store.open(spec.base_weights_ref)
                command["checkpoints"] = [record.to_json()]
        self.local = cast(ModelResource, spmd.call(command, store=store))
        self.lora = self.local.lora
        self.entry, self.spec, self.store = self.local.entry, self.local.spec, self.local.store
        self.batcher = DistributedBatcher(self.id, spmd.call)

    def __getattr__(self, name: str) -> Any:  # has_generator, vocab_size, tokenizer, ...
        return getattr(self.local, name)

    def create_session(self, session_id: str, spec: SessionSpec) -> DistributedSession:
        checkpoints = []
        if spec.resume_from_checkpoint_id:  # the other ranks resume what rank 0 verified
            with contextlib.suppress(KeyError, CheckpointCorrupt):
                record, manifest = self.store.open(spec.resume_from_checkpoint_id)
                if not is_encrypted(manifest):  # an encrypted export: every rank refuses it
                    checkpoints.append(record.to_json())
        command = {
            "op": "create_session",
            "resource": self.id,
            "session": session_id,
            "spec": spec.model_dump(mode="json"),
            "checkpoints": checkpoints,
        }
        local = cast(TrainingSession, self._spmd.call(command))
        return DistributedSession(self._spmd, self.id, local, self.batcher)

    def counters(self) -> dict[str, int]:
        return self.local.counters()

    def close_session(self, session_id: str) -> None:
        command = {"op": "close_session", "resource": self.id, "session": session_id}
        self._spmd.call(command)

    def close(self) -> None:
        self._spmd.call({"op": "close_resource", "resource": self.id})


def resource_loader(
    spmd: Spmd,
) -> Callable[[ModelEntry, ResourceSpec, CheckpointStore, str | None], DistributedResource]:
    """A drop-in for `trainer.serving.engine_protocols.load_resource` on rank 0 (the device is per
    rank)."""

    def load(
        entry: ModelEntry, spec: ResourceSpec, store: CheckpointStore, device: str | None
    ) -> DistributedResource:
        return DistributedResource(spmd, entry, spec, store)

    return load
