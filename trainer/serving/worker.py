"""The worker's state machine: resources, sessions and their operation queues, and shutdown.

Route handlers call into one `Worker`; it owns the catalogue (`Catalogue`), the engine's
`CheckpointStore`, payload files, the loaded resources and one FIFO queue per live session.
Blocking calls (engine work, joins) are made from worker threads, never the event loop.

Beside it: a resource's load and expiry (`lifecycle`), a new session's checks and row
(`session_open`), the open sessions and their queues (`live_sessions`, `queues`), and the
users' quotas (`quotas`).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from trainer.checkpoint.base_weights import FIELD, RefError, shown_ref
from trainer.checkpoint.store import CheckpointRecord, CheckpointStore
from trainer.contract.specs import ResourceSpec
from trainer.serving.catalogue import (
    RES_ERROR,
    RES_READY,
    RES_STOPPED,
    SES_EXPIRED,
    SES_LIVE,
    SES_RUNNING,
    SES_STOPPED,
    Catalogue,
    OperationRow,
    ResourceRow,
    SessionRow,
)
from trainer.serving.config import ServeConfig
from trainer.serving.engine_protocols import load_resource
from trainer.serving.errors import ApiError, bad_request, failed_precondition, not_found
from trainer.serving.lifecycle import Loader, ResourceManager
from trainer.serving.live_sessions import LiveSessions, session_row
from trainer.serving.ownership import owned, visible
from trainer.serving.payloads import PayloadFiles
from trainer.serving.queues import CountedCall, EngineCall, Job, OperationLog
from trainer.serving.quotas import check_live_quota, storage_used, within_storage
from trainer.serving.requests import CreateSessionBody, check_lora, overlay_metadata
from trainer.serving.resume import checked_resume
from trainer.serving.session_open import check_capacity, check_ident, creating_row
from trainer.serving.tenants import LOCAL, Principal
from trainer.serving.users import acting_user

log = logging.getLogger(__name__)

__all__ = ["CountedCall", "EngineCall", "Worker"]  # the calls are `queues`'s, named here too


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
        self.live = LiveSessions(config, self.store, self.oplog, self.payloads, self.resources)
        self.sessions = self.live.table  # the open sessions, under `lock`
        self.lock = self.live.lock
        self.abandoned: list[str] = []  # ops still running when shutdown gave up on them
        # a user's principal (its quotas) by user id: the API layer's keys (`set by create_app`)
        self.principals: Callable[[str], Principal | None] = lambda user: None
        # a checkpoint every user may read (the Tinker face's published ones: `install`)
        self.checkpoint_shared: Callable[[CheckpointRecord], bool] = lambda record: False

    @property
    def draining(self) -> bool:
        """Shutting down: no new sessions or operations."""
        return self.live.draining

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
        check_ident(ident)
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
        check_quota = functools.partial(
            check_live_quota, self.store, ResourceRow, who.user, "max_resources", limit
        )
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
        self.live.close(active, SES_STOPPED, self.config.shutdown_grace_s)
        self.resources.release(resource_id)
        if self.resource(resource_id).status not in (RES_STOPPED, RES_ERROR):
            self.store.update(ResourceRow, resource_id, status=RES_STOPPED, expires_at=None)
        return self.resource(resource_id)

    def sweep(self, now: float) -> list[str]:
        """Stop resources idle past `expires_at`; their sessions become EXPIRED. Also writes
        the operation statuses that a full disk refused, once it can."""
        self.oplog.flush()
        expired = self.resources.expired(now, self.live.busy)
        for resource_id in expired:
            log.info("resource %s expired after inactivity", resource_id)
            active = [s for s in self.store.sessions_of(resource_id) if s.status in SES_LIVE]
            self.live.close(active, SES_EXPIRED, 5.0)
            self.resources.release(resource_id)
        return expired

    # -- sessions --------------------------------------------------------------------------

    def session(self, session_id: str, who: Principal | None = None) -> SessionRow:
        """The session's row; with `who`, only one `who` sees (another's: the same 404)."""
        return session_row(self.store, session_id, who)

    def checkpoint_owner(self, record: CheckpointRecord) -> str | None:
        """The user who owns a checkpoint: the owner of the session that saved it."""
        row = self.store.get(SessionRow, record.session_id) if record.session_id else None
        return row.owner if row is not None else None

    def checkpoint(self, checkpoint_id: str, who: Principal | None, field: str) -> CheckpointRecord:
        """A checkpoint `who` may read (its own, or a shared one: `checkpoint_shared`); another
        user's is missing (the same 404 naming `field`)."""
        record = self.checkpoints.get(checkpoint_id)
        return owned(
            record,
            who,
            "checkpoint",
            checkpoint_id,
            field,
            owner=self.checkpoint_owner,
            shared=self.checkpoint_shared,
        )

    def live_policy(self, session_id: str) -> tuple[int, dict[str, Any]] | None:
        return self.live.policy(session_id)

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
        check_ident(ident)
        if ident is not None and self.store.get(SessionRow, ident) is not None:
            raise failed_precondition(f"training session {ident!r} already exists", "id")
        spec, row = creating_row(body, res_row.id, lora_enabled, resuming, ident, who, internal)
        with self.lock:  # the counts and the insert together: concurrent creates cannot overshoot
            cap = self.config.max_sessions_per_resource
            check_capacity(self.store, res_row.id, lora_enabled, cap)
            if not internal:
                limit = who.quotas.max_sessions
                check_live_quota(self.store, SessionRow, who.user, "max_sessions", limit)
            self.store.insert(row)
        self.resources.touch(res_row.id)
        future: Future[SessionRow] = Future()
        engine = live_res.engine
        threading.Thread(
            target=self.live.open,
            args=(row.id, res_row.id, engine, spec, future),
            name=f"open-{row.id}",
            daemon=True,
        ).start()
        return row.id, future

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
            self.live.close([row], SES_STOPPED, 5.0)
        return self.session(session_id)

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
        return storage_used(self.store, self.checkpoints, self.payloads, user)

    def storage_quota(self, user: str | None) -> int | None:
        principal = self.principals(user) if user is not None else None
        return principal.quotas.max_storage_bytes if principal is not None else None

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
        if kind in ("training-checkpoint", "inference-checkpoint"):  # undone past the quota
            limit, delete = self.storage_quota(row.owner), self.checkpoints.delete
            call = within_storage(call, row.owner, limit, self.storage_used, delete)
        op = self.oplog.create(session_id, kind, key, body_hash)
        live = self.live.get(session_id)
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

    # -- shutdown --------------------------------------------------------------------------

    def shutdown(self, grace_s: float) -> None:
        """No new operations; queued ones fail; the running ones get `grace_s` to finish.

        One still running then is abandoned: recorded FAILED (a late finish records nothing
        more) and listed in `abandoned`, its thread still computing. The server then exits
        without interpreter teardown, which would abort under a thread inside torch.
        """
        self.live.draining = True
        with self.lock:
            lives = list(self.sessions.values())
        self.live.close([self.session(s.id) for s in lives], SES_STOPPED, grace_s)
        self.oplog.closed = True
        self.oplog.flush()  # statuses a full disk held back, if it has room now
        self.abandoned.extend(self.live.abandon(lives))
        for resource_id in list(self.resources.live):
            if not self.live.busy(resource_id):
                self.resources.release(resource_id)
            else:
                self.store.update(ResourceRow, resource_id, status=RES_STOPPED, expires_at=None)
        self.store.recover(time.time())  # anything still marked live is stopped now
        self.store.close()
        self.checkpoints.close()
        log.info("worker stopped")
