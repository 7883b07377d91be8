"""The user a piece of work is done for, as the metrics and the audit trail name it.

The API's auth dependencies set `ACTING_USER` for the request they let in
(`trainer.api.auth`, `trainer.api.tinker.face`); the worker reads it when an operation is
submitted (`Worker.submit`), so an operation counts for the user whose request queued it. The
Tinker face runs its requests on dispatcher threads, which copy the request's context
(`TinkerBridge.dispatch`). Outside a request (preloads, tests driving the worker directly) the
user is `local`, the single token's user.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

from trainer.serving.tenants import LOCAL_USER

ACTING_USER: ContextVar[str] = ContextVar("acting_user", default=LOCAL_USER)


def acting_user() -> str:
    return ACTING_USER.get()


def owner_of(row: Any) -> str:
    """The user a catalogue row belongs to: its `owner` where rows record one, else `local`."""
    owner = getattr(row, "owner", None)
    return owner if isinstance(owner, str) and owner else LOCAL_USER
