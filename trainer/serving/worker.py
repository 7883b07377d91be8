"""The worker's state machine: resources, sessions and their operation queues, and shutdown.

Route handlers call into one `Worker`; it owns the catalogue (`Catalogue`), the engine's
`CheckpointStore`, payload files, the loaded resources and one FIFO queue per live session.
Blocking calls (engine work, joins) are made from worker threads, never the event loop.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from trainer.checkpoint.base_weights import FIELD, RefError, shown_ref
from trainer.checkpoint.store import CheckpointCorrupt, CheckpointRecord, CheckpointStore
from trainer.contract.errors import OperationError
from trainer.contract.specs import LoraConfig, ResourceSpec, SessionSpec
from trainer.serving.catalogue import (
    OP_FAILED,
    RES_ERROR,
    RES_READY,
    RES_STOPPED,
    SES_CREATING,
    SES_ERROR,
    SES_EXPIRED,
    SES_LIVE,
    SES_RUNNING,
    SES_STOPPED,
    SES_STOPPING,
    Catalogue,
    OperationRow,
    ResourceRow,
    SessionRow,
)
from trainer.serving.config import ServeConfig
from trainer.serving.engine_protocols import EngineResource, EngineSession, load_resource
from trainer.serving.errors import ApiError, bad_request, failed_precondition, not_found
from trainer.serving.ids import SAFE_ID, is_safe_id
from trainer.serving.lifecycle import Loader, ResourceManager, at_capacity, error_body
from trainer.serving.ownership import owned, visible
from trainer.serving.payloads import PayloadFiles, offload_result
from trainer.serving.queues import Job, OperationLog, SessionQueue, op_error
from trainer.serving.requests import CreateSessionBody, check_lora, overlay_metadata
from trainer.serving.resume import checked_resume
from trainer.serving.tenants import LOCAL, QUOTA_PREFIX, Principal, over_quota
from trainer.serving.users import acting_user

log = logging.getLogger(__name__)

EngineCall = Callable[[EngineSession], dict[str, Any]]


@dataclass(frozen=True)
class CountedCall:
    """An engine call with the tokens it trains on, for the metrics (`Operation.call`)."""

    run: EngineCall
    trained_tokens: int = 0

    def __call__(self, session: EngineSession) -> dict[str, Any]:
        return self.run(session)


def _check_ident(ident: str | None) -> None:
    """Caller-chosen ids (preloads) become file names: keep them to a safe alphabet."""
    if ident is not None and not is_safe_id(ident):
        raise bad_request(f"id: {ident!r} must match {SAFE_ID.pattern}", "id")


def _effective_lora(session: EngineSession, fallback: Any) -> Any:
    """The LoRA config the session trains with (a resumed checkpoint's own, not the request's)."""
    config = session.lora_config
    return config.model_dump(mode="json") if config is not None else fallback


@dataclass
class LiveSession:
    id: str
    resource_id: str
    engine: EngineSession
    queue: SessionQueue
    final_status: str = SES_STOPPED


class Worker:
    def __init__(self, config: ServeConfig, loader: Loader | None = None) -> None:
        from trainer.compute.model import resolve_context_limit

        config.storage.mkdir(parents=True, exist_ok=True)
        # each model's own context length (or a smaller configured one) is its max_seq_length
        config.models = [resolve_context_limit(m) for m in config.models]
        self.config = config
        self.store = Catalogue(config.storage / "worker.sqlite")
        self.store.recover(time.time())
        self.checkpoints = CheckpointStore(config.storage)
        self.payloads = PayloadFiles(config.storage / "payloads", config.max_payload_bytes)
        self.resources = ResourceManager(
            self.store,
            self.checkpoints,
            loader or functools.partial(load_resource, options=config.engine),
            config.device,
            config.max_resources,
        )
        self.oplog = OperationLog(self.store)
        self.sessions: dict[str, LiveSession] = {}
        self.lock = threading.RLock()
        self.draining = False
        self._stop_requested: set[str] = set()
        self.abandoned: list[str] = []  # ops still running when shutdown gave up on them
        # a user's principal (its quotas) by user id: the API layer's keys (`set by create_app`)
        self.principals: Callable[[str], Principal | None] = lambda user: None

    # -- resources -------------------------------------------------------------------------

    def create_resource(
        self,
        spec: ResourceSpec,
        ident: str | None = None,
        who: Principal = LOCAL,
        shared: bool = False,
    ) -> ResourceRow:
        """A new resource owned by `who` (its `max_resources` quota checked with the insert,
        under the lifecycle's lock: racing creates never pass it)."""
        _check_ident(ident)
        if shared and not spec.lora_enabled:
            raise bad_request(
                "shared: only a LoRA resource hosts several users' sessions", "shared"
            )
        ref = spec.base_weights_ref
        if ref:  # another user's checkpoint reads as no checkpoint at all
            record = self.checkpoints.get(ref)
            if record is not None and not visible(who, self.checkpoint_owner(record)):
                missing = RefError(f"no checkpoint {shown_ref(ref)} on this worker")
                raise bad_request(str(missing), FIELD)
        limit = who.quotas.max_resources

        def check_quota() -> None:
            if limit is None:
                return
            used = self.store.count_live_owned(ResourceRow, who.user)
            if used >= limit:
                raise over_quota("max_resources", limit, used)

        return self.resources.create(
            spec, self.config.models, ident, owner=who.user, shared=shared, check=check_quota
        )

    def resource_loaded(self, resource_id: str) -> Future[None] | None:
        """Resolves once the resource's load has settled (None: it has settled already)."""
        live = self.resources.get_live(resource_id)
        return None if live is None else live.loaded

    def generator_details(self, resource_id: str) -> dict[str, Any]:
        """What serves a live resource's samples (its replicas' states), for `status_details`."""
        live = self.resources.get_live(resource_id)
        if live is None or live.engine is None or live.stopped:
            return {}
        return {"generator": live.engine.generator_status()}

    def generator_health(self) -> dict[str, int]:
        """Counts of the live resources' vLLM replicas by state, for `/healthz`."""
        counts: dict[str, int] = {}
        for live in self.resources.live_resources():
            status = live.engine.generator_status() if live.engine is not None else {}
            for replica in status.get("replicas", []):
                counts[replica["state"].lower()] = counts.get(replica["state"].lower(), 0) + 1
        return counts

    def resource(
        self, resource_id: str, who: Principal | None = None, manage: bool = False
    ) -> ResourceRow:
        """The resource's row; with `who`, only one `who` may see (its own, any for an admin,
        a `shared` one for reading and hosting sessions): another is missing, the same 404.
        `manage` (stop, extend): a shared resource of another user is a 403."""
        row = owned(
            self.store.get(ResourceRow, resource_id),
            who,
            "model resource",
            resource_id,
            "model_resources_id",
            shared=lambda r: r.shared,
        )
        if manage and not visible(who, row.owner):  # shared with `who`, not theirs
            raise ApiError(
                403,
                f"model_resources_id: model resource {resource_id} is shared with you; only its "
                "owner or an admin stops or extends it",
                param="model_resources_id",
                code="permission_denied",
            )
        return row

    def extend_expiry(
        self, resource_id: str, seconds: int, who: Principal | None = None
    ) -> ResourceRow:
        self.resources.extend(self.resource(resource_id, who, manage=True), seconds)
        return self.resource(resource_id)

    def stop_resource(
        self, resource_id: str, force: bool, who: Principal | None = None
    ) -> ResourceRow:
        """Blocking (joins session queues): call from a worker thread."""
        row = self.resource(resource_id, who, manage=True)
        if row.status in (RES_STOPPED, RES_ERROR):
            return row
        active = [s for s in self.store.sessions_of(resource_id) if s.status in SES_LIVE]
        if active and not force:
            raise failed_precondition(
                f"model resource {resource_id} has {len(active)} active session(s) "
                f"({', '.join(s.id for s in active)}); stop them first or pass force=true",
                "force",
            )
        self._close_sessions(active, SES_STOPPED, self.config.shutdown_grace_s)
        self.resources.release(resource_id)
        if self.resource(resource_id).status not in (RES_STOPPED, RES_ERROR):
            self.store.update(ResourceRow, resource_id, status=RES_STOPPED, expires_at=None)
        return self.resource(resource_id)

    def sweep(self, now: float) -> list[str]:
        """Stop resources idle past `expires_at`; their sessions become EXPIRED. Also writes
        the operation statuses that a full disk refused, once it can."""
        self.oplog.flush()
        expired = self.resources.expired(now, self._resource_busy)
        for resource_id in expired:
            log.info("resource %s expired after inactivity", resource_id)
            active = [s for s in self.store.sessions_of(resource_id) if s.status in SES_LIVE]
            self._close_sessions(active, SES_EXPIRED, 5.0)
            self.resources.release(resource_id)
        return expired

    def _resource_busy(self, resource_id: str) -> bool:
        with self.lock:
            return any(s.queue.busy for s in self.sessions.values() if s.resource_id == resource_id)

    # -- sessions --------------------------------------------------------------------------

    def session(self, session_id: str, who: Principal | None = None) -> SessionRow:
        """The session's row; with `who`, only one `who` sees (another's: the same 404)."""
        return owned(
            self.store.get(SessionRow, session_id),
            who,
            "training session",
            session_id,
            "session_id",
        )

    def checkpoint_owner(self, record: CheckpointRecord) -> str | None:
        """The user who owns a checkpoint: the owner of the session that saved it."""
        row = self.store.get(SessionRow, record.session_id) if record.session_id else None
        return row.owner if row is not None else None

    def checkpoint(self, checkpoint_id: str, who: Principal | None, field: str) -> CheckpointRecord:
        """A checkpoint `who` may see; another user's is missing (the same 404 naming `field`)."""
        record = self.checkpoints.get(checkpoint_id)
        return owned(record, who, "checkpoint", checkpoint_id, field, owner=self.checkpoint_owner)

    def live_policy(self, session_id: str) -> tuple[int, dict[str, Any]] | None:
        with self.lock:
            live = self.sessions.get(session_id)
        if live is None:
            return None
        return int(live.engine.step), dict(live.engine.policy_state())

    def create_session(
        self,
        body: CreateSessionBody,
        ident: str | None = None,
        who: Principal = LOCAL,
        internal: bool = False,
    ) -> tuple[str, Future[SessionRow]]:
        """Record the session (CREATING), owned by `who`, and open it in the engine from a
        thread. `who` must see the resource (its own, or a shared one) and the checkpoint it
        resumes from; its `max_sessions` quota is checked with the insert (`internal`
        sessions, which the worker opens for itself, count against no quota).

        The future resolves to the RUNNING row, to an ERROR row (unexpected engine failure),
        or raises the engine's `OperationError` (the row is then ERROR too).
        """
        if self.draining:
            raise failed_precondition("the worker is shutting down")
        res_row = self.resource(body.model_resources_id, who)
        live_res = self.resources.get_live(res_row.id)
        if res_row.status != RES_READY or live_res is None or live_res.engine is None:
            raise failed_precondition(
                f"model_resources_id: model resource {res_row.id} is {res_row.status}; "
                "sessions attach only to a READY resource",
                "model_resources_id",
            )
        lora_enabled = live_res.spec.lora_enabled
        resuming = bool(body.resume_from_checkpoint_id or body.resume_from_hf_checkpoint)
        if not (resuming and lora_enabled):  # a resumed LoRA session keeps its checkpoint's
            check_lora(body.lora_config, live_res.entry, lora_enabled)
        body = checked_resume(self, body, who, live_res)
        _check_ident(ident)
        if ident is not None and self.store.get(SessionRow, ident) is not None:
            raise failed_precondition(f"training session {ident!r} already exists", "id")
        lora = (body.lora_config or LoraConfig()) if lora_enabled else None
        spec = SessionSpec.model_validate(
            {**body.model_dump(exclude={"model_resources_id"}), "lora_config": lora}
        )
        now = time.time()
        row = SessionRow(
            id=ident or f"ts_{uuid.uuid4().hex}",
            resource_id=res_row.id,
            spec=spec.model_dump(mode="json"),
            status=SES_CREATING,
            created_at=now,
            updated_at=now,
            display_name=body.display_name or None,
            metadata=body.metadata.model_dump(mode="json", exclude_none=True),
            # a resumed session's config is its checkpoint's: known once it is open
            lora_config=lora.model_dump(mode="json") if lora is not None and not resuming else None,
            owner=who.user,
            internal=internal,
        )
        with self.lock:  # the counts and the insert together: concurrent creates cannot overshoot
            self._check_capacity(res_row.id, lora_enabled)
            cap = who.quotas.max_sessions
            if cap is not None and not internal:
                used = self.store.count_live_owned(SessionRow, who.user)
                if used >= cap:
                    raise over_quota("max_sessions", cap, used)
            self.store.insert(row)
        self.resources.touch(res_row.id)
        future: Future[SessionRow] = Future()
        engine = live_res.engine
        threading.Thread(
            target=self._open_session,
            args=(row.id, res_row.id, engine, spec, future),
            name=f"open-{row.id}",
            daemon=True,
        ).start()
        return row.id, future

    def _check_capacity(self, resource_id: str, lora_enabled: bool) -> None:
        live = sum(s.status in SES_LIVE for s in self.store.sessions_of(resource_id))
        field = "model_resources_id"
        if not lora_enabled and live:
            raise failed_precondition(
                f"{field}: full-weight resource {resource_id} already hosts its one "
                "session (RESOURCE_AT_CAPACITY)",
                field,
            )
        cap = self.config.max_sessions_per_resource
        if live >= cap:
            raise at_capacity(
                f"model resource {resource_id} already hosts {live} live sessions "
                f"(max_sessions_per_resource {cap}, RESOURCE_AT_CAPACITY); stop one first",
                field,
            )

    def _open_session(
        self,
        session_id: str,
        resource_id: str,
        engine: EngineResource,
        spec: SessionSpec,
        future: Future[SessionRow],
    ) -> None:
        try:
            session = engine.create_session(session_id, spec)
        except OperationError as exc:
            code = (
                "TRAINING_SESSION_ERROR_CODE_RESOURCE_AT_CAPACITY"
                if exc.code == "RESOURCE_EXHAUSTED"
                else "TRAINING_SESSION_ERROR_CODE_SESSION_FAILED"
            )
            self.store.update(
                SessionRow, session_id, status=SES_ERROR, error=error_body(code, exc.message)
            )
            future.set_exception(exc)
            return
        except Exception as exc:  # an engine bug must not leave the session CREATING forever
            log.exception("session %s: opening failed", session_id)
            self.store.update(
                SessionRow,
                session_id,
                status=SES_ERROR,
                error=error_body(
                    "TRAINING_SESSION_ERROR_CODE_SESSION_FAILED",
                    f"opening the session failed: {type(exc).__name__}: {exc}",
                ),
            )
            future.set_result(self.session(session_id))
            return
        queue = SessionQueue(
            session_id,
            finish=lambda job: self._finish(session_id, job),
            on_closed=lambda: self._closed(session_id),
        )
        with self.lock:
            self.sessions[session_id] = LiveSession(session_id, resource_id, session, queue)
        self.store.update(
            SessionRow,
            session_id,
            status=SES_RUNNING,
            step=int(session.step),
            policy_state=dict(session.policy_state()),
            lora_config=_effective_lora(session, self.session(session_id).lora_config),
        )
        log.info("session %s running on %s", session_id, resource_id)
        live_res = self.resources.get_live(resource_id)
        stop = session_id in self._stop_requested
        if stop or live_res is None or live_res.stopped or self.draining:
            self._close_sessions([self.session(session_id)], SES_STOPPED, 5.0)
        future.set_result(self.session(session_id))

    def update_session(
        self, session_id: str, display_name: str | None, metadata: dict[str, Any] | None
    ) -> SessionRow:
        row = self.session(session_id)
        changes: dict[str, Any] = {}
        if display_name is not None:
            changes["display_name"] = display_name or None
        if metadata is not None:
            changes["metadata"] = overlay_metadata(row.metadata, metadata)
        if changes:
            self.store.update(SessionRow, session_id, **changes)
        return self.session(session_id)

    def stop_session(self, session_id: str) -> SessionRow:
        """Blocking (joins the queue briefly): call from a worker thread."""
        row = self.session(session_id)
        if row.status in SES_LIVE:
            self._close_sessions([row], SES_STOPPED, 5.0)
        return self.session(session_id)

    def _close_sessions(self, rows: list[SessionRow], final: str, wait_s: float) -> None:
        """Cancel queued operations, let running ones finish (up to `wait_s`), then close."""
        closing: list[LiveSession] = []
        for row in rows:
            with self.lock:
                live = self.sessions.get(row.id)
            if live is None:  # still CREATING: `_open_session` closes it once open
                self._stop_requested.add(row.id)
                self.store.update(SessionRow, row.id, status=SES_STOPPING)
                continue
            live.final_status = final
            self.store.update(SessionRow, row.id, status=SES_STOPPING)
            for job in live.queue.close():
                self.oplog.fail(job.op_id, "SESSION_NOT_ACTIVE", "the session stopped first")
                job.done.set_result(None)
            closing.append(live)
        deadline = time.monotonic() + wait_s
        for live in closing:
            live.queue.join(max(0.0, deadline - time.monotonic()))

    def _closed(self, session_id: str) -> None:
        """Runs in the session's queue thread once its last job is done."""
        with self.lock:
            live = self.sessions.pop(session_id, None)
        if live is None or self.oplog.closed:
            return
        live_res = self.resources.get_live(live.resource_id)
        status, error = live.final_status, None
        if live_res is not None and live_res.engine is not None:
            try:
                live_res.engine.close_session(session_id)
            except Exception as exc:  # report it on the session; the slot state is unknown
                log.exception("session %s: closing failed", session_id)
                status = SES_ERROR
                error = error_body(
                    "TRAINING_SESSION_ERROR_CODE_SESSION_FAILED",
                    f"closing the session failed: {type(exc).__name__}: {exc}",
                )
        self.store.update(SessionRow, session_id, status=status, error=error)
        self.payloads.drop_session(session_id)
        log.info("session %s %s", session_id, status)

    # -- operations ------------------------------------------------------------------------

    def find_operation(self, session_id: str, kind: str, op_id: str) -> OperationRow:
        row = self.store.get(OperationRow, op_id)
        if row is None or row.session_id != session_id or row.kind != kind:
            raise not_found(f"{kind} operation", op_id, "operation_id")
        return self.oplog.view(row)

    def op_by_key(self, session_id: str, idem_key: str) -> OperationRow | None:
        row = self.store.op_by_key(session_id, idem_key)
        return None if row is None else self.oplog.view(row)

    def storage_used(self, user: str) -> int:
        """Bytes on disk of `user`'s checkpoints (of every session it opened) and payloads."""
        session_ids = self.store.session_ids_of(user)
        total = 0
        for record in self.checkpoints.list(session_ids=session_ids, limit=1 << 30):
            try:
                total += sum(f.size for f in self.checkpoints.manifest_files(record.id))
            except (KeyError, CheckpointCorrupt):
                continue
        return total + sum(self.payloads.session_bytes(s) for s in session_ids)

    def storage_quota(self, user: str | None) -> int | None:
        principal = self.principals(user) if user is not None else None
        return principal.quotas.max_storage_bytes if principal is not None else None

    def _within_storage(self, owner: str | None, call: EngineCall) -> EngineCall:
        """A checkpoint save that leaves `owner` past its `max_storage_bytes` is undone (its
        checkpoint deleted) and FAILs RESOURCE_EXHAUSTED naming the quota."""
        limit = self.storage_quota(owner)
        if limit is None or owner is None:
            return call

        def checked(engine: Any) -> dict[str, Any]:
            out = call(engine)
            used = self.storage_used(owner)
            if used > limit:
                checkpoint_id = str((out.get("checkpoint") or {}).get("id") or "")
                if checkpoint_id:
                    self.checkpoints.delete(checkpoint_id)
                raise OperationError(
                    "RESOURCE_EXHAUSTED",
                    f"{QUOTA_PREFIX}max_storage_bytes: the checkpoint would bring {owner}'s "
                    f"checkpoints and payloads to {used} bytes, past {limit}; delete some first",
                )
            return out

        return checked

    def submit(
        self,
        session_id: str,
        kind: str,
        key: str,
        body_hash: str,
        call: EngineCall,
        user: str | None = None,
    ) -> OperationRow:
        """Record an operation and queue it on its session (FAILED at once if not RUNNING).
        `user`: whose request it is, for the metrics (default: the request's, `acting_user`)."""
        row = self.session(session_id)
        if kind in ("training-checkpoint", "inference-checkpoint"):
            call = self._within_storage(row.owner, call)
        op = self.oplog.create(session_id, kind, key, body_hash)
        with self.lock:
            live = self.sessions.get(session_id)
        if self.draining:
            self.oplog.fail(op.id, "SESSION_NOT_ACTIVE", "the worker is shutting down")
        elif live is None or row.status != SES_RUNNING:
            self.oplog.fail(op.id, "SESSION_NOT_ACTIVE", f"session {session_id} is {row.status}")
        else:
            tokens = call.trained_tokens if isinstance(call, CountedCall) else 0
            user = user or acting_user()
            job = Job(op.id, kind, lambda: call(live.engine), user=user, trained_tokens=tokens)
            if live.queue.submit(job):
                self.oplog.futures[op.id] = job.done
                self.resources.touch(live.resource_id)
            else:
                self.oplog.fail(op.id, "SESSION_NOT_ACTIVE", f"session {session_id} is stopping")
        return self.find_operation(session_id, kind, op.id)

    def _finish(self, session_id: str, job: Job) -> None:
        """Runs in the session's queue thread: the job, then the session's bookkeeping."""
        limit = self.config.result_offload_bytes
        self.oplog.run(job, lambda out: offload_result(self.payloads, session_id, out, limit))
        self.oplog.futures.pop(job.op_id, None)
        with self.lock:
            live = self.sessions.get(session_id)
        if live is None or self.oplog.closed:
            return
        self.store.update(
            SessionRow,
            session_id,
            step=int(live.engine.step),
            policy_state=dict(live.engine.policy_state()),
        )
        self.resources.touch(live.resource_id)

    # -- shutdown --------------------------------------------------------------------------

    def shutdown(self, grace_s: float) -> None:
        """No new operations; queued ones fail; the running ones get `grace_s` to finish.

        One still running then is abandoned: recorded FAILED (a late finish records nothing
        more) and listed in `abandoned`, its thread still computing. The server then exits
        without interpreter teardown, which would abort under a thread inside torch.
        """
        self.draining = True
        with self.lock:
            lives = list(self.sessions.values())
        self._close_sessions([self.session(s.id) for s in lives], SES_STOPPED, grace_s)
        self.oplog.closed = True
        self.oplog.flush()  # statuses a full disk held back, if it has room now
        for live in lives:
            running = live.queue.running
            if running is not None:
                log.warning("abandoning op %s %s at shutdown", running.kind, running.op_id)
                self.abandoned.append(running.op_id)
                error = op_error("SESSION_NOT_ACTIVE", "the worker shut down while it ran")
                self.store.update(OperationRow, running.op_id, status=OP_FAILED, error=error)
                self.store.update(SessionRow, live.id, status=SES_STOPPED)
        for resource_id in list(self.resources.live):
            if not self._resource_busy(resource_id):
                self.resources.release(resource_id)
            else:
                self.store.update(ResourceRow, resource_id, status=RES_STOPPED, expires_at=None)
        self.store.recover(time.time())  # anything still marked live is stopped now
        self.store.close()
        self.checkpoints.close()
        log.info("worker stopped")
