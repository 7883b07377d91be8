"""A new session before and after the engine opens it: the checks made before it is recorded
(a safe caller-chosen id, the resource's capacity), its CREATING row, the LoRA config it
reports once open, and the error an engine failure to open or close it leaves on its row.

The worker (`trainer.serving.worker`) calls these in order: it holds the lock and the state.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from trainer.contract.errors import OperationError
from trainer.contract.specs import LoraConfig, SessionSpec
from trainer.serving.catalogue import SES_CREATING, SES_LIVE, Catalogue, SessionRow
from trainer.serving.engine_protocols import EngineSession
from trainer.serving.errors import bad_request, failed_precondition
from trainer.serving.ids import SAFE_ID, is_safe_id
from trainer.serving.lifecycle import at_capacity, error_body
from trainer.serving.requests import CreateSessionBody
from trainer.serving.tenants import Principal

SESSION_FAILED = "TRAINING_SESSION_ERROR_CODE_SESSION_FAILED"
FIELD = "model_resources_id"


def check_ident(ident: str | None) -> None:
    """Caller-chosen ids (preloads) become file names: keep them to a safe alphabet."""
    if ident is not None and not is_safe_id(ident):
        raise bad_request(f"id: {ident!r} must match {SAFE_ID.pattern}", "id")


def check_capacity(store: Catalogue, resource_id: str, lora_enabled: bool, cap: int) -> None:
    """Room for one more live session on the resource: a full-weight one hosts one, a LoRA
    one up to `cap` (`max_sessions_per_resource`)."""
    live = sum(s.status in SES_LIVE for s in store.sessions_of(resource_id))
    if not lora_enabled and live:
        raise failed_precondition(
            f"{FIELD}: full-weight resource {resource_id} already hosts its one "
            "session (RESOURCE_AT_CAPACITY)",
            FIELD,
        )
    if live >= cap:
        raise at_capacity(
            f"model resource {resource_id} already hosts {live} live sessions "
            f"(max_sessions_per_resource {cap}, RESOURCE_AT_CAPACITY); stop one first",
            FIELD,
        )


def creating_row(
    body: CreateSessionBody,
    resource_id: str,
    lora_enabled: bool,
    resuming: bool,
    ident: str | None,
    who: Principal,
    internal: bool,
) -> tuple[SessionSpec, SessionRow]:
    """The engine's spec of a new session and its CREATING row, owned by `who`."""
    lora = (body.lora_config or LoraConfig()) if lora_enabled else None
    spec = SessionSpec.model_validate(
        {**body.model_dump(exclude={"model_resources_id"}), "lora_config": lora}
    )
    now = time.time()
    row = SessionRow(
        id=ident or f"ts_{uuid.uuid4().hex}",
        resource_id=resource_id,
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
    return spec, row


def effective_lora(session: EngineSession, fallback: Any) -> Any:
    """The LoRA config the session trains with (a resumed checkpoint's own, not the request's)."""
    config = session.lora_config
    return config.model_dump(mode="json") if config is not None else fallback


def refused(exc: OperationError) -> dict[str, object]:
    """The error of a session the engine refused to open (at capacity, or another reason)."""
    code = (
        "TRAINING_SESSION_ERROR_CODE_RESOURCE_AT_CAPACITY"
        if exc.code == "RESOURCE_EXHAUSTED"
        else SESSION_FAILED
    )
    return error_body(code, exc.message)


def failed(doing: str, exc: Exception) -> dict[str, object]:
    """The error of a session whose `doing` ("opening", "closing") crashed in the engine."""
    return error_body(SESSION_FAILED, f"{doing} the session failed: {type(exc).__name__}: {exc}")
