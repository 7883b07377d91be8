"""The Tinker face's way into the engine: resources, sessions and operations of the worker.

A Tinker model is a training session on a LoRA resource for its base model, created on demand
from the catalogue (one shared resource per base model, reused by every Tinker model and
sampler, and made again when it was stopped or the worker restarted). Each model and each
sampling session has a dispatcher (`trainer.api.tinker.dispatch`): the owner's requests run in
arrival order (the SDK submits a model's requests one at a time, in `seq_id` order), each to
the end: the engine operation queued with `Worker.submit`, waited for, its result translated
and stored on the request's future. `load_state` swaps the model onto a new session between
two requests, so what follows it runs on the loaded weights.

A future's outcome that `tinker.sqlite` cannot take (its disk is full) is held in memory and
served from there, so a client polling it still sees it settle; it is written once space is
freed (`flush`, run by the periodic sweep and at shutdown). At shutdown (`drain`) queued
requests fail cleanly and running ones finish while the engine still serves them.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import re
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from trainer.api.tinker.dispatch import Dispatchers, Task
from trainer.api.tinker.identity import RequestKey
from trainer.api.tinker.records import (
    DONE,
    FAILED,
    PENDING,
    TinkerFuture,
    TinkerModel,
    TinkerRecords,
    TinkerSession,
)
from trainer.api.tinker.stability import StabilityRecords
from trainer.api.tinker.waiters import Waiters
from trainer.contract.errors import OperationError
from trainer.contract.specs import ModelEntry, ResourceSpec
from trainer.serving.catalogue import (
    RES_READY,
    SES_RUNNING,
)
from trainer.serving.errors import ApiError, bad_request, is_disk_full
from trainer.serving.operations import OPERATIONS, prepare_call, run_to_end
from trainer.serving.requests import CreateSessionBody
from trainer.serving.tenants import Principal, is_quota_refusal
from trainer.serving.worker import EngineCall, Worker

log = logging.getLogger(__name__)

USER_CODES = ("INVALID_INPUT", "NON_FINITE_LOSS")


def category_of(code: str, message: str) -> str:
    """A failure's category as the SDK reads it: the user's (bad input, a non-finite loss, a
    quota of theirs reached) or the server's (a full disk included)."""
    return "user" if code in USER_CODES or is_quota_refusal(message) else "server"


RESOURCE_IDLE_S = 86400  # Tinker resources live as long as the catalogue allows when idle
SESSION_TIMEOUT_S = 600.0  # the SDK heartbeats every 10 s; silence this long ends a session
FUTURE_TTL_S = 6 * 3600.0  # settled futures are kept this long for their clients to fetch
NOT_RUN = (
    "the worker shut down before this request ran; once it has restarted, load the model "
    "again (load_state) and send the request again"
)
SHUT_DOWN = (
    "the worker shut down while this request ran; once it has restarted, load the model "
    "again (load_state) and send the request again"
)
DISK_FULL = "the worker's disk is full; send the request again once space is freed"


# The engine's body fields that a Tinker request names otherwise, per operation
_TINKER_NAMES = {
    "forward-backward": (("samples", "forward_backward_input.data"),),
    "embedding-forward-backward": (
        ("samples", "forward_backward_input.data"),
        ("objective", "forward_backward_input.loss_fn_config"),
    ),
    "sample": (("model_inputs[0]", "prompt"),),
}


def tinker_names(kind: str, text: str) -> str:
    """`text` (an error message or param) with the engine's field names of operation `kind`
    replaced by the Tinker request's (`samples[2].model_input` ->
    `forward_backward_input.data[2].model_input`)."""
    if kind == "forward-backward":  # a datum's R3 routes sit on its model input
        text = re.sub(
            r"(samples\[\d+\])\.routing_matrices", r"\1.model_input.routing_matrices", text
        )
    if kind == "embedding-forward-backward":  # a datum's gradient is one of its inputs
        text = re.sub(
            r"(?<![\w.\]])gradients\[(\d+)\]",
            r"samples[\1].loss_fn_inputs.embedding_grads",
            text,
        )
    for ours, theirs in _TINKER_NAMES.get(kind, ()):
        text = re.sub(rf"(?<![\w.\]]){re.escape(ours)}(?=[\[.:]|$)", theirs, text)
    return text


def tinker_named(kind: str, exc: ApiError) -> ApiError:
    param = None if exc.param is None else tinker_names(kind, exc.param)
    return ApiError(exc.status, tinker_names(kind, exc.message), param=param, code=exc.code)


class RequestFailed(Exception):
    """A request's failure as the SDK reads it: a message and a category (user or server)."""

    def __init__(self, message: str, category: str = "user") -> None:
        super().__init__(message)
        self.message = message
        self.category = category


class TinkerBridge:
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.db = TinkerRecords(worker.config.storage / "tinker.sqlite")
        engine = worker.config.engine
        self.stability = StabilityRecords(
            worker.config.storage / "tinker_stability.sqlite",
            engine.stability_ttl_s,
            engine.stability_max_bytes,
        )
        failed = self.db.recover()
        if failed:
            log.info("tinker: %d requests pending at the last stop failed cleanly", failed)
        self.waiters = Waiters()
        self.dispatchers = Dispatchers()
        self.on_sessions_ended: list[Callable[[list[str]], None]] = []
        # `load_adapter`'s model names (`accounts/<a>/models/<m>`): each resolver answers the
        # PEFT directory a name is for the caller, or None (not its name, or not theirs); the
        # Fireworks face appends its promoted models' (`routes_firetitan.load_adapter`)
        self.model_resolvers: list[Callable[[str, Principal], Path | None]] = []
        self._resource_lock = threading.Lock()
        self._resources: dict[str, str] = {}  # base model -> the resource this face made
        self._write_lock = threading.Lock()  # a future's write, `flush` and `close`
        self._held: dict[str, dict[str, Any]] = {}  # request id -> outcome not yet written
        self._closed = False

    # -- futures ---------------------------------------------------------------------------

    def future(
        self, owner: str, kind: str, key: RequestKey, user: str
    ) -> tuple[TinkerFuture, bool]:
        """A new pending future, or the one this request's identity already made (False); a
        409 when another request made it (`RequestKey.same`). Keys are looked up among
        `user`'s futures only: another user's key names none of theirs."""
        if key.key:
            scoped = f"{user}|{key.key}"
            key = replace(key, key=scoped)
            existing = self.db.future_by_key(scoped)
            if existing is not None:
                return key.same(existing), False
        now = time.time()
        row = TinkerFuture(
            id=f"req_{uuid.uuid4().hex}",
            model_id=owner,
            kind=kind,
            status=PENDING,
            created_at=now,
            updated_at=now,
            idem_key=key.key,
            body_hash=key.digest,
            owner=user,
        )
        try:
            self.db.insert(row)
        except sqlite3.IntegrityError:  # a concurrent retry with the same key won the insert
            existing = self.db.future_by_key(key.key or "")
            if existing is None:
                raise
            return key.same(existing), False
        return row, True

    def lookup(self, request_id: str) -> TinkerFuture | None:
        """The future as its client sees it: the stored row with an outcome the disk could
        not take yet applied."""
        row = self.db.get(TinkerFuture, request_id)
        with self._write_lock:
            held = self._held.get(request_id)
        return replace(row, **held) if row is not None and held else row

    def finish(self, request_id: str, result: dict[str, Any]) -> None:
        self._settle(request_id, status=DONE, result=result)

    def fail(self, request_id: str, message: str, category: str) -> None:
        self._settle(request_id, status=FAILED, error=message, category=category)

    def _settle(self, request_id: str, **changes: Any) -> None:
        """Write a future's outcome and wake its pollers; on a full disk hold it in memory
        until `flush`. After `close` nothing is written: the next start fails it."""
        changes["updated_at"] = time.time()
        with self._write_lock:
            if self._closed:
                return
            try:
                self.db.update(TinkerFuture, request_id, **changes)
            except Exception as exc:
                if not is_disk_full(exc):
                    raise
                log.error("tinker request %s: tinker.sqlite is full; held in memory", request_id)
                self._held[request_id] = changes
            else:
                self._held.pop(request_id, None)
        self.waiters.notify(request_id)

    def flush(self) -> int:
        """Write the outcomes a full disk refused; how many are still held."""
        with self._write_lock:
            if self._closed:
                return len(self._held)
            for request_id, changes in list(self._held.items()):
                try:
                    self.db.update(TinkerFuture, request_id, **changes)
                except Exception as exc:  # still full (or another storage error): keep it
                    if not is_disk_full(exc):
                        log.exception("tinker request %s: writing its outcome failed", request_id)
                    continue
                del self._held[request_id]
            return len(self._held)

    def start(
        self,
        owner: str,
        kind: str,
        key: RequestKey,
        work: Callable[[str], dict[str, Any]],
        who: Principal,
    ) -> str:
        """The request's future id: a new future (of `who`) whose `work(request_id)` runs on
        the owner's dispatcher, or the future an earlier try of the same request made."""
        future, new = self.future(owner, kind, key, who.user)
        if new:
            self.dispatch(owner, future.id, lambda: work(future.id))
        return future.id

    def dispatch(self, owner: str, request_id: str, work: Callable[[], dict[str, Any]]) -> None:
        """Run `work` after the owner's earlier requests; its result or failure completes the
        future (an unexpected error is a server-category failure, never a lost future). It
        runs in the request's context, so its operations count for the request's user
        (`trainer.serving.users`)."""
        context = contextvars.copy_context()

        def run() -> None:
            context.run(_run)

        def _run() -> None:
            try:
                result = work()
            except RequestFailed as exc:
                self.fail(request_id, exc.message, exc.category)
            except ApiError as exc:
                self.fail(request_id, exc.message, "user" if exc.status < 500 else "server")
            except OperationError as exc:
                category = category_of(exc.code, exc.message)
                self.fail(request_id, f"{exc.code}: {exc.message}", category)
            except Exception as exc:
                self._crashed(request_id, exc)
            else:
                self.finish(request_id, result)

        if not self.dispatchers.submit(owner, Task(request_id, run)):
            self.fail(request_id, NOT_RUN, "server")

    def _crashed(self, request_id: str, exc: Exception) -> None:
        if self.dispatchers.stopped:  # the worker shut down under it (its stores may be closed)
            log.info("tinker request %s: the worker shut down while it ran", request_id)
            self.fail(request_id, SHUT_DOWN, "server")
        elif is_disk_full(exc):
            log.error("tinker request %s: the disk is full: %s", request_id, exc)
            self.fail(request_id, DISK_FULL, "server")
        else:
            log.exception("tinker request %s crashed", request_id)
            self.fail(request_id, f"internal error: {type(exc).__name__}: {exc}", "server")

    def sweep(self, now: float) -> list[str]:
        """Write held outcomes; end the Tinker sessions whose heartbeats stopped (their models'
        engine sessions and the sampler sessions only they used close; their checkpoints
        stay), and forget long-settled futures."""
        self.flush()
        try:
            ended = self._end_silent_sessions(now)
            self.db.prune(now - FUTURE_TTL_S)
            self.stability.expire()
        except Exception as exc:  # a full disk: the next sweep tries again
            if not is_disk_full(exc):
                raise
            log.error("tinker sweep: tinker.sqlite is full; retried at the next sweep")
            return []
        return ended

    def _end_silent_sessions(self, now: float) -> list[str]:
        ended = self.db.select(
            TinkerSession, "ended_at IS NULL AND heartbeat_at < ?", (now - SESSION_TIMEOUT_S,)
        )
        for session in ended:
            log.info(
                "tinker session %s ended: no heartbeat for %.0fs", session.id, SESSION_TIMEOUT_S
            )
            self.db.update(TinkerSession, session.id, ended_at=now)
            for model in self.db.select(TinkerModel, "tinker_session = ?", (session.id,)):
                self.release(model)
        ids = [s.id for s in ended]
        if ids:
            for hook in self.on_sessions_ended:
                hook(ids)
        return ids

    def drain(self, grace_s: float) -> bool:
        """The first step of shutdown, while the engine still runs: no new request is taken,
        the queued ones fail cleanly, the running ones get `grace_s` seconds to finish. True
        if none is left running."""
        self._stop_dispatchers()
        return self.dispatchers.join(grace_s)

    def _stop_dispatchers(self) -> None:
        for request_id in self.dispatchers.stop():
            self.fail(request_id, NOT_RUN, "server")

    def close(self) -> None:
        """The last step of shutdown: held outcomes written if they fit, the store closed."""
        self._stop_dispatchers()
        self.flush()
        with self._write_lock:
            self._closed = True
            self.db.close()
            self.stability.close()

    # -- the catalogue, resources and sessions --------------------------------------------

    def entry(self, base_model: str, field: str = "base_model") -> ModelEntry:
        entry = self.worker.config.model(base_model)
        if entry is None:
            served = [m.name for m in self.worker.config.models]
            raise bad_request(
                f"{field}: {base_model!r} is not served by this worker; supported: {served}",
                field,
            )
        return entry

    def resource_for(self, base_model: str) -> str:
        """The Tinker face's READY LoRA resource (AdamW, one generator) for `base_model`: the
        one it made before, else a new one (blocking while it loads). Resources made through
        the RL session API are never borrowed: their owners may stop or reconfigure them."""
        with self._resource_lock:
            resource_id = self._resources.get(base_model)
            live = self.worker.resources.get_live(resource_id) if resource_id else None
            if live is None or live.stopped:
                spec = ResourceSpec(
                    base_model=base_model, lora_enabled=True, inactive_timeout=RESOURCE_IDLE_S
                )
                # every user's Tinker models share it (merged passes); it counts for no one
                resource_id = self.worker.create_resource(spec, shared=True).id
                self._resources[base_model] = resource_id
        assert resource_id is not None
        loaded = self.worker.resource_loaded(resource_id)
        if loaded is not None:
            loaded.result()
        row = self.worker.resource(resource_id)
        if row.status != RES_READY:
            error = (row.error or {}).get("message", row.status)
            raise RequestFailed(f"loading base model {base_model!r} failed: {error}", "server")
        return resource_id

    def open_session(
        self,
        resource_id: str,
        spec: dict[str, Any],
        field: str,
        who: Principal,
        internal: bool = False,
    ) -> str:
        """A RUNNING training session on `resource_id`, owned by `who` (blocking while it
        opens); `internal`: a sampler's, which counts against no quota."""
        body = CreateSessionBody.model_validate({**spec, "model_resources_id": resource_id})
        session_id, future = self.worker.create_session(body, who=who, internal=internal)
        try:
            row = future.result()
        except OperationError as exc:
            category = category_of(exc.code, exc.message)
            raise RequestFailed(f"{field}: {exc.message}", category) from None
        if row.status != SES_RUNNING:
            message = (row.error or {}).get("message", row.status)
            raise RequestFailed(f"{field}: opening the session failed: {message}", "server")
        return session_id

    def stop_session(self, session_id: str) -> None:
        with contextlib.suppress(ApiError):
            self.worker.stop_session(session_id)

    def release(self, model: TinkerModel) -> None:
        """Close the model's session, and the full-weight resource it made for itself
        (unbound full weights: `models.py`), which would hold its owner's quota until idle."""
        self.stop_session(model.session_id)
        if model.lora_rank == 0 and not model.frozen and model.scope is None:
            with contextlib.suppress(ApiError):
                self.worker.stop_resource(model.resource_id, force=True)

    # -- operations ------------------------------------------------------------------------

    def prepare(
        self,
        session_id: str,
        kind: str,
        body: dict[str, Any],
        extra: dict[str, Any] | None = None,
    ) -> EngineCall:
        """Validate an operation body against the model's limits (a 400 naming the field,
        by its Tinker name); `extra`: engine keyword arguments no body carries."""
        try:
            return prepare_call(
                self.worker, session_id, OPERATIONS[kind], body, extra, rl_face=False
            )
        except ApiError as exc:
            raise tinker_named(kind, exc) from None

    def run(
        self, model: TinkerModel | str, kind: str, call: EngineCall, key: str
    ) -> dict[str, Any]:
        """Queue `call` on the model's session now and wait for its output."""
        session_id = model if isinstance(model, str) else self.current_session(model.id)
        if not isinstance(model, str):
            self._touch(model.id)
        error, output = run_to_end(self.worker, session_id, kind, f"tinker:{key}", key, call)
        if error is not None:
            code = str(error.get("code", "")).removeprefix("TRAINING_OPERATION_ERROR_CODE_")
            category = category_of(code, str(error.get("message", "")))
            message = tinker_names(kind, str(error.get("message", "failed")))
            raise RequestFailed(f"{code}: {message}", category)
        return output

    def _touch(self, model_id: str) -> None:
        """Record the model's last request (skipped when the disk is full: the request runs)."""
        try:
            self.db.update(TinkerModel, model_id, last_request_at=time.time())
        except Exception as exc:
            if not is_disk_full(exc):
                raise

    def current_session(self, model_id: str) -> str:
        model = self.db.get(TinkerModel, model_id)
        if model is None:
            raise RequestFailed(f"model_id: no model {model_id!r}")
        return model.session_id
