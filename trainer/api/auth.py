"""The key check of every `/v1/rl/...` route: `Authorization: Bearer <key>` names the user the
request acts for (`trainer.api.keys.KeyRing`, constant-time; keys are never logged). The
principal is left on `request.state.principal` for the routes, the audit trail and the metrics.
"""

from __future__ import annotations

from fastapi import Request

from trainer.api.keys import LOCAL, KeyRing, Principal
from trainer.serving.errors import ApiError
from trainer.serving.users import ACTING_USER


def principal_of(request: Request) -> Principal:
    """The principal the auth dependency found (`local` where auth is off)."""
    found = getattr(request.state, "principal", None)
    return found if isinstance(found, Principal) else LOCAL


NOBODY = "\x00nobody"
"""`listed_owner` of a filter that names a user the caller may not list: an empty page."""


def listed_owner(who: Principal, created_by: str | None) -> str | None:
    """The owner a listing shows: the caller's own objects (`created_by` empty, `me` or the
    caller), or, for an admin, everyone's (None) or one user's. A user asking for another
    user's objects gets `NOBODY`, so the page is empty, as for a user with none."""
    if created_by in (None, "", "me"):
        return None if who.admin else who.user
    if who.admin or created_by == who.user:
        return created_by
    return NOBODY


class BearerAuth:
    """FastAPI dependency: `Authorization: Bearer <key>` must be a key in force."""

    def __init__(self, keys: KeyRing | str | None) -> None:
        self.keys = keys if isinstance(keys, KeyRing) else KeyRing(token=keys)

    async def __call__(self, request: Request) -> None:
        if self.keys.open:
            request.state.principal = LOCAL
            ACTING_USER.set(LOCAL.user)
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise ApiError(
                401, "missing bearer token in the Authorization header", code="invalid_api_key"
            )
        principal = self.keys.identify(given.strip())
        if principal is None:
            raise ApiError(401, "invalid API token", code="invalid_api_key")
        request.state.principal = principal
        ACTING_USER.set(principal.user)  # the operations this request queues count for it
