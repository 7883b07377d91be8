"""Model-resource lifecycle: background load, inactivity expiry, stop.

PENDING (recorded) -> CREATING (loading the model in a thread) -> READY, or ERROR with
`MODEL_RESOURCES_ERROR_CODE_PROVISIONING_FAILED` and the loader's message. `loaded` resolves
once the load has settled either way (the create route waits on it, bounded). A READY resource
stops on its own once `expires_at` (last activity + `inactive_timeout`, never moving earlier)
has passed with no operation running; its sessions then show EXPIRED. At most `max_resources`
are live at once (each holds its own copy of its model): one more is refused with a 400.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from trainer.checkpoint.base_weights import FIELD, RefError, cached_config, check_ref
from trainer.checkpoint.store import CheckpointStore
from trainer.contract.specs import ModelEntry, ResourceSpec
from trainer.serving.catalogue import (
    RES_CREATING,
    RES_ERROR,
    RES_PENDING,
    RES_READY,
    RES_STOPPED,
    Catalogue,
    ResourceRow,
)
from trainer.serving.engine_protocols import EngineResource
from trainer.serving.errors import ApiError, bad_request, failed_precondition

log = logging.getLogger(__name__)

Loader = Callable[[ModelEntry, ResourceSpec, CheckpointStore, "str | None"], EngineResource]


def error_body(code: str, message: str) -> dict[str, object]:
    return {"code": code, "message": message, "occurred_at": time.time()}


def at_capacity(message: str, param: str) -> ApiError:
    """A cap is reached: a 400 (not retried by the SDK) naming the field and the cap."""
    return ApiError(400, f"{param}: {message}", param=param, code="resource_at_capacity")


@dataclass
class LiveResource:
    """A resource this process has (or is loading): its engine object and activity clock."""

    id: str
    entry: ModelEntry
    spec: ResourceSpec
    engine: EngineResource | None = None
    expires_at: float = 0.0
    stopped: bool = False
    ready: threading.Event = field(default_factory=threading.Event)
    loaded: Future[None] = field(default_factory=Future)  # resolves with `ready`

    def touch(self, now: float) -> float:
        self.expires_at = max(self.expires_at, now + self.spec.inactive_timeout)
        return self.expires_at


class ResourceManager:
    def __init__(
        self,
        store: Catalogue,
        checkpoints: CheckpointStore,
        loader: Loader,
        device: str | None,
        max_resources: int = 8,
    ) -> None:
        self.store = store
        self.checkpoints = checkpoints
        self.loader = loader
        self.device = device
        self.max_resources = max_resources
        self.live: dict[str, LiveResource] = {}
        self.lock = threading.RLock()

    def create(
        self,
        spec: ResourceSpec,
        models: list[ModelEntry],
        ident: str | None = None,
        owner: str | None = None,
        shared: bool = False,
        check: Callable[[], None] | None = None,
    ) -> ResourceRow:
        """A new resource's row, its model loading in a thread. `check` (a quota) runs under
        the lock that also holds the count of live resources and the insert."""
        entry = next((m for m in models if m.name == spec.base_model), None)
        if entry is None:
            raise bad_request(
                f"base_model: {spec.base_model!r} is not served by this worker; "
                f"supported: {[m.name for m in models]}",
                "base_model",
            )
        if spec.base_weights_ref:
            self._check_base_weights(spec, entry)
        if ident is not None and self.store.get(ResourceRow, ident) is not None:
            raise failed_precondition(f"model resource {ident!r} already exists", "id")
        now = time.time()
        row = ResourceRow(
            id=ident or f"mr_{uuid.uuid4().hex}",
            spec=spec.model_dump(mode="json"),
            status=RES_PENDING,
            created_at=now,
            updated_at=now,
            owner=owner,
            shared=shared,
        )
        live = LiveResource(id=row.id, entry=entry, spec=spec)
        with self.lock:  # the count and the insert together: concurrent creates cannot overshoot
            if check is not None:
                check()
            if len(self.live) >= self.max_resources:
                raise at_capacity(
                    f"cannot load {entry.name!r}: this worker already holds {len(self.live)} "
                    "live model resources "
                    f"(max_resources {self.max_resources}, RESOURCE_AT_CAPACITY); stop one first",
                    "base_model",
                )
            self.store.insert(row)
            self.live[row.id] = live
        threading.Thread(
            target=self._load, args=(live,), name=f"load-{row.id}", daemon=True
        ).start()
        return row

    def _check_base_weights(self, spec: ResourceSpec, entry: ModelEntry) -> None:
        """`base_weights_ref` names one of our inference checkpoints with a merged model of
        `entry`'s architecture (`trainer.checkpoint.base_weights`), else a 400 naming it. When the
        base
        model's config is not on this machine yet, the loader compares against the loaded
        model. Runs on the event loop: local files only, nothing downloaded."""
        base_config = cached_config(entry.location, entry.revision)
        try:
            check_ref(
                self.checkpoints,
                spec.base_weights_ref or "",
                spec.lora_enabled,
                entry.name,
                base_config,
            )
        except RefError as exc:
            raise bad_request(str(exc), FIELD) from None

    def _load(self, live: LiveResource) -> None:
        with self.lock:
            if live.stopped:
                _settle(live)
                return
            self.store.update(ResourceRow, live.id, status=RES_CREATING)
        started = time.perf_counter()
        try:
            engine = self.loader(live.entry, live.spec, self.checkpoints, self.device)
        except Exception as exc:  # any load failure (path, config, OOM) is the resource's ERROR
            log.exception("resource %s: loading %s failed", live.id, live.entry.name)
            with self.lock:
                self.live.pop(live.id, None)
            if not live.stopped:
                self.store.update(
                    ResourceRow,
                    live.id,
                    status=RES_ERROR,
                    error=error_body(
                        "MODEL_RESOURCES_ERROR_CODE_PROVISIONING_FAILED",
                        f"loading {live.entry.name} from {live.entry.location} failed: "
                        f"{type(exc).__name__}: {exc}",
                    ),
                )
            _settle(live)
            return
        with self.lock:
            if live.stopped:  # stopped while loading: release at once
                engine.close()
                _settle(live)
                return
            live.engine = engine
            expires_at = live.touch(time.time())
        # The model and the modules its load imported live as long as the resource: out of
        # the cyclic collector's full scans, as at start-up (`server.freeze_long_lived`). The
        # engine frees by reference counting when released.
        gc.freeze()
        self.store.update(ResourceRow, live.id, status=RES_READY, expires_at=expires_at)
        log.info(
            "resource %s ready: %s in %.1fs",
            live.id,
            live.entry.name,
            time.perf_counter() - started,
        )
        _settle(live)

    def live_resources(self) -> list[LiveResource]:
        with self.lock:
            return list(self.live.values())

    def get_live(self, resource_id: str) -> LiveResource | None:
        with self.lock:
            return self.live.get(resource_id)

    def touch(self, resource_id: str) -> None:
        live = self.get_live(resource_id)
        if live is not None and live.engine is not None and not live.stopped:
            before = live.expires_at
            after = live.touch(time.time())
            if after - before >= 1.0:  # keep the catalogue write rate bounded
                self.store.update(ResourceRow, resource_id, expires_at=after)

    def extend(self, row: ResourceRow, seconds: int) -> None:
        """`expires_at` >= now + seconds; refused unless READY."""
        live = self.get_live(row.id)
        if row.status != RES_READY or live is None:
            raise failed_precondition(
                f"model resource {row.id} is {row.status}; only a READY resource can be extended"
            )
        live.expires_at = max(live.expires_at, time.time() + seconds)
        self.store.update(ResourceRow, row.id, expires_at=live.expires_at)

    def release(self, resource_id: str, status: str = RES_STOPPED) -> None:
        """Forget the resource and free its model (sessions must be closed already)."""
        with self.lock:
            live = self.live.pop(resource_id, None)
            if live is None:
                return
            live.stopped = True
            engine = live.engine
            live.engine = None
        if engine is not None:
            engine.close()
        self.store.update(ResourceRow, resource_id, status=status, expires_at=None)
        log.info("resource %s released (%s)", resource_id, status)

    def expired(self, now: float, busy: Callable[[str], bool]) -> list[str]:
        """READY resources past `expires_at` with nothing running (busy ones are touched)."""
        out: list[str] = []
        with self.lock:
            candidates = [r for r in self.live.values() if r.engine is not None and not r.stopped]
        for live in candidates:
            if busy(live.id):
                self.touch(live.id)
            elif now >= live.expires_at:
                out.append(live.id)
        return out


def _settle(live: LiveResource) -> None:
    """The load is over (READY, ERROR or stopped): wake whoever waits on it."""
    live.ready.set()
    if not live.loaded.done():
        live.loaded.set_result(None)
