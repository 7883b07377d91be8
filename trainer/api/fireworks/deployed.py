"""What a deployment serves: engine sessions of its base model on this worker, and the
hot-loads that change them (docs/semantics.md §24).

- Before any hot-load, the base model: a rank-1 LoRA session whose B matrices are zero on the
  Tinker face's shared LoRA resource of the base model (as `tinker.sampling` samples a base).
- A LoRA sampler checkpoint: a session resumed from it (weights only) on that shared resource,
  its own copy of the adapter (the trainer moves on while the deployment samples this one).
  The last `MAX_ADAPTERS` loaded stay open, least recently loaded closing first; all are
  `loaded_adapters`, the last one loaded is what completions sample.
- A full-weight sampler checkpoint: the deployment's own full-weight resource (owned by its
  account, so it counts against that account's `max_resources`), with one session resumed
  from the checkpoint, replaced by a new session on each full hot-load. A LoRA hot-load
  after it releases that resource (once the completions holding its session end).
Sessions are the worker's own (`internal`, principal LOCAL): the caller's right to the
checkpoint was checked when the hot-load was accepted (`hotload.snapshot_of`). Whether a
resource generates in-process or on vLLM replicas follows the worker's `[generator]`
configuration of the catalogue entry, as for every engine session.

One loader thread per deployment applies hot-loads in order; a hot-load asked for while one
is in flight is applied next (the newest wins). A session a completion holds (`Target`) is
never closed under it: the hold is counted, and a replaced session closes at its release.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainer.api.fireworks.targets import Target
from trainer.api.tinker.bridge import RequestFailed, TinkerBridge
from trainer.api.tinker.models import BASE_LORA
from trainer.contract.specs import ResourceSpec
from trainer.serving.catalogue import RES_READY, SES_RUNNING, SessionRow
from trainer.serving.errors import ApiError
from trainer.serving.tenants import LOCAL, Principal

log = logging.getLogger(__name__)
MAX_ADAPTERS = 4
HOLD_WAIT_S = 60.0  # a full hot-load waits this long for completions on the old weights
FULL_IDLE_S = 86400  # the full-weight resource's inactivity timeout (it serves completions)
IDLE, LOADING, DONE, ERROR = "idle", "loading", "done", "error"


@dataclass(frozen=True)
class Snapshot:
    """A checkpoint a deployment can serve: its identity as the client named it."""

    identity: str
    checkpoint_id: str
    lora: bool


class Deployed:
    """The generator of one deployment. `start` and `load` block (call off the event loop)."""

    def __init__(
        self,
        bridge: TinkerBridge,
        name: str,
        base_model: str,
        owner: Principal,
        on_loaded: Callable[[Snapshot], None],
    ) -> None:
        self.bridge = bridge
        self.name = name  # accounts/<a>/deployments/<d>
        self.base_model = base_model  # the catalogue entry
        self.owner = owner
        self.on_loaded = on_loaded
        self.lock = threading.Lock()
        self.released = threading.Condition(self.lock)  # notified when a hold ends
        self.opening = threading.Lock()  # held while sessions open or close for a load
        self.base_session: str | None = None
        self.adapters: OrderedDict[str, tuple[Snapshot, str]] = OrderedDict()  # -> session
        self.full: tuple[Snapshot, str] | None = None
        self.full_resource: str | None = None
        self.full_leaving: tuple[str, str] | None = None  # (session, resource) to release
        self.current: Snapshot | None = None  # what completions sample; None: the base model
        self.pending: Snapshot | None = None  # the next load
        self.target: str | None = None  # the identity of the load in flight or last asked
        self.stage = IDLE
        self.error: str | None = None
        self.loader: threading.Thread | None = None
        self.in_use: dict[str, int] = {}  # session id -> completions holding it
        self.retired: set[str] = set()  # replaced sessions, closed once no longer held
        self.stopped = False

    # -- serving ---------------------------------------------------------------------------

    def start(self) -> None:
        """Open the base model's session (loading the shared resource if needed)."""
        with self.opening:
            self._ensure_base()

    def _ensure_base(self) -> str:
        session_id = self.base_session
        if session_id is None or not self._running(session_id):
            resource_id = self.bridge.resource_for(self.base_model)
            spec = {"lora_config": dict(BASE_LORA), "display_name": f"{self.name} base"[:128]}
            session_id = self._open(resource_id, spec)
            self.base_session = session_id
        return session_id

    def _open(self, resource_id: str, spec: dict[str, Any]) -> str:
        return self.bridge.open_session(resource_id, spec, "identity", LOCAL, internal=True)

    def _running(self, session_id: str) -> bool:
        row = self.bridge.worker.store.get(SessionRow, session_id)
        return row is not None and row.status == SES_RUNNING

    def _full_resource(self) -> str:
        """The deployment's READY full-weight resource, made (again) when it is not live."""
        worker = self.bridge.worker
        resource_id = self.full_resource
        live = worker.resources.get_live(resource_id) if resource_id else None
        if resource_id is None or live is None or live.stopped:
            spec = ResourceSpec(
                base_model=self.base_model, lora_enabled=False, inactive_timeout=FULL_IDLE_S
            )
            resource_id = worker.create_resource(spec, who=self.owner).id
            self.full_resource = resource_id
        loaded = worker.resource_loaded(resource_id)
        if loaded is not None:
            loaded.result()
        row = worker.resource(resource_id)
        if row.status != RES_READY:
            error = (row.error or {}).get("message", row.status)
            raise ApiError(503, f"loading {self.base_model!r} for full weights failed: {error}")
        return resource_id

    def _load(self, snapshot: Snapshot) -> str:
        """Open a session serving `snapshot` and make it the current one (holding
        `opening`); the session it replaces is retired."""
        spec = {
            "resume_from_checkpoint_id": snapshot.checkpoint_id,
            "load_optimizer": False,
            "display_name": f"{self.name} {snapshot.identity}"[:128],
        }
        if snapshot.lora:
            session_id = self._open(self.bridge.resource_for(self.base_model), spec)
        else:
            session_id = self._open_full(spec)
        closing: list[str] = []
        with self.lock:
            if snapshot.lora:
                old = self.adapters.pop(snapshot.identity, None)
                self.adapters[snapshot.identity] = (snapshot, session_id)
                if old is not None:
                    closing += self._retire(old[1])
                for identity in list(self.adapters):
                    if len(self.adapters) <= MAX_ADAPTERS:
                        break
                    closing += self._retire(self.adapters.pop(identity)[1])
                if self.full is not None and self.full_resource is not None:
                    self.full_leaving = (self.full[1], self.full_resource)
                    closing += self._retire(self.full[1])
                    self.full, self.full_resource = None, None
            else:
                self.full = (snapshot, session_id)
            self.current = snapshot
        for old_id in closing:
            self.bridge.stop_session(old_id)
        self._release_left_resource()
        return session_id

    def _release_left_resource(self) -> None:
        """Stop the full-weight resource a LoRA hot-load replaced, once no completion holds
        its session (else this runs again at that session's release)."""
        with self.lock:
            leaving = self.full_leaving
            if leaving is None or self.in_use.get(leaving[0], 0) > 0:
                return
            self.full_leaving = None
        with contextlib.suppress(ApiError):
            self.bridge.worker.stop_resource(leaving[1], force=True)

    def _open_full(self, spec: dict[str, Any]) -> str:
        """A session of `spec` on the full-weight resource, which hosts one session: the one
        it replaces closes first (once the completions holding it end, up to
        `HOLD_WAIT_S`); when the new one fails to open, the old snapshot opens again, so the
        deployment keeps serving what it served."""
        resource_id = self._full_resource()
        previous = self.full
        if previous is not None:
            with self.lock:
                self.released.wait_for(
                    lambda: self.in_use.get(previous[1], 0) == 0, timeout=HOLD_WAIT_S
                )
                self.full = None
            self.bridge.stop_session(previous[1])
        try:
            return self._open(resource_id, spec)
        except (RequestFailed, ApiError):
            if previous is not None:
                old = previous[0]
                again = {"resume_from_checkpoint_id": old.checkpoint_id, "load_optimizer": False}
                with contextlib.suppress(RequestFailed, ApiError):
                    self.full = (old, self._open(resource_id, again))
            raise

    def _retire(self, session_id: str) -> list[str]:
        """Under `lock`: the sessions to close now (not held), else closed at release."""
        if self.in_use.get(session_id, 0) > 0:
            self.retired.add(session_id)
            return []
        return [session_id]

    def _current_session(self) -> str | None:
        """Under `lock`: the session of what completions sample, if open."""
        current = self.current
        if current is None:
            return self.base_session
        if current.lora:
            found = self.adapters.get(current.identity)
            return found[1] if found is not None else None
        return self.full[1] if self.full is not None else None

    def hold(self, name: str) -> Target:
        """The session completions sample now, held until `release`; 425 while a hot-load
        is in flight. Blocking when the session must open again (its resource expired)."""
        with self.lock:
            self._check_serving(name)
            current = self.current
            session_id = self._current_session()
            if session_id is not None and self._running(session_id):
                self.in_use[session_id] = self.in_use.get(session_id, 0) + 1
            else:
                session_id = None
        if session_id is None:
            with self.opening:
                with self.lock:
                    self._check_serving(name)
                    current = self.current
                    session_id = self._current_session()
                if session_id is None or not self._running(session_id):
                    session_id = self._reopen(name, current)
                with self.lock:
                    self.in_use[session_id] = self.in_use.get(session_id, 0) + 1
        released = threading.Event()

        def release() -> None:
            if not released.is_set():
                released.set()
                self._release(session_id)

        identity = current.identity if current is not None else None
        return Target(name, self.base_model, session_id, identity, release)

    def _reopen(self, name: str, current: Snapshot | None) -> str:
        """Open again what the deployment serves (its session ended: the resource expired or
        was stopped); a 503 naming `model` when that fails (never other weights instead)."""
        try:
            return self._ensure_base() if current is None else self._load(current)
        except (RequestFailed, ApiError) as exc:
            message = getattr(exc, "message", None) or str(exc)
            raise ApiError(
                503, f"model: deployment {name!r} could not load again: {message}", param="model"
            ) from None

    def _check_serving(self, name: str) -> None:
        """Under `lock`: a 425 while a hot-load is in flight, a 400 once stopped."""
        if self.stopped:
            raise ApiError(400, f"model: deployment {name!r} serves no replicas", param="model")
        if self.stage == LOADING:
            raise ApiError(
                425,
                f"model: deployment {name!r} is loading {self.target!r}; retry shortly",
                param="model",
                code="too_early",
            )

    def _release(self, session_id: str) -> None:
        closing = False
        with self.lock:
            count = self.in_use.get(session_id, 1) - 1
            if count > 0:
                self.in_use[session_id] = count
            else:
                self.in_use.pop(session_id, None)
                closing = session_id in self.retired
                self.retired.discard(session_id)
                self.released.notify_all()
        if closing:
            self.bridge.stop_session(session_id)
            self._release_left_resource()

    # -- hot-loads -------------------------------------------------------------------------

    def hot_load(self, snapshot: Snapshot) -> None:
        """Load `snapshot` in the background (after the load in flight, if any)."""
        with self.lock:
            if self.stopped:
                return
            self.pending = snapshot
            self.target = snapshot.identity
            self.stage, self.error = LOADING, None
            if self.loader is not None and self.loader.is_alive():
                return
            self.loader = threading.Thread(
                target=self._load_loop, name=f"hot-load {self.name}", daemon=True
            )
            self.loader.start()

    def settle(self, timeout_s: float) -> None:
        """Wait, at most `timeout_s`, for the hot-loads asked so far to end (either way)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                if self.stage != LOADING or self.stopped:
                    return
            time.sleep(0.01)

    def expect(self, snapshot: Snapshot) -> None:
        """Read as loading `snapshot` from now on; `hot_load` it once the base serves."""
        with self.lock:
            self.target = snapshot.identity
            self.stage, self.error = LOADING, None

    def _load_loop(self) -> None:
        while True:
            with self.lock:
                snapshot, self.pending = self.pending, None
                if snapshot is None or self.stopped:
                    self.loader = None
                    return
            error = None
            try:
                with self.opening:
                    self._load(snapshot)
            except Exception as exc:  # a failed load is data: stage "error" and its reason
                error = getattr(exc, "message", None) or str(exc) or type(exc).__name__
                log.warning("%s: hot-load of %s failed: %s", self.name, snapshot.identity, error)
            with self.lock:
                if self.pending is None:  # else a newer hot-load follows
                    self.stage = DONE if error is None else ERROR
                    self.error = error
                    if error is not None:
                        self.target = snapshot.identity
            if error is None:
                self.on_loaded(snapshot)

    # -- status ----------------------------------------------------------------------------

    def replica(self) -> dict[str, Any]:
        """One replica's entry of the hot-load status (the SDK's strict schema)."""
        with self.lock:
            current = self.current.identity if self.current is not None else None
            state: dict[str, Any] = {"stage": self.stage, "target_snapshot_identity": self.target}
            if self.error is not None:
                state["error"] = self.error
            adapters = [{"identity": i, "status": "loaded"} for i in reversed(self.adapters)]
            return {
                "current_snapshot_identity": current,
                "readiness": self.stage != LOADING and not self.stopped,
                "loading_state": state,
                "loaded_adapters": adapters,
            }

    def stop(self) -> None:
        """Release every engine session and the full-weight resource (scale to zero, delete,
        shutdown); a held session closes at its release. Blocking."""
        with self.lock:
            self.stopped = True
            self.pending = None
            loader = self.loader
        if loader is not None and loader is not threading.current_thread():
            loader.join(30)
        closing: list[str] = []
        with self.opening, self.lock:
            sessions = [self.base_session] if self.base_session else []
            sessions += [s for _, s in self.adapters.values()]
            sessions += [self.full[1]] if self.full is not None else []
            for session_id in sessions:
                closing += self._retire(session_id)
            self.base_session, self.full = None, None
            self.adapters.clear()
            resources = [self.full_resource] if self.full_resource else []
            resources += [self.full_leaving[1]] if self.full_leaving else []
            self.full_resource, self.full_leaving = None, None
        for session_id in closing:
            self.bridge.stop_session(session_id)
        for resource_id in resources:
            with contextlib.suppress(ApiError):
                self.bridge.worker.stop_resource(resource_id, force=True)
