"""The key check of every `/v1/rl/...` route: `Authorization: Bearer <key>` names the user the
request acts for (`trainer.api.keys.KeyRing`, constant-time; keys are never logged). The
principal is left on `request.state.principal` for the routes, the audit trail and the metrics.
"""

from __future__ import annotations

from collections.abc import Mapping

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


class KeyAuth:
    """FastAPI dependency: the request's key must be a key in force (`KeyRing`, constant-time);
    its principal goes on `request.state.principal` and `ACTING_USER` (the operations the
    request queues count for it). Each face says where its key travels (`key_of`) and how a
    missing key is asked for (`missing`); the RL face's is the bearer token."""

    missing = "missing bearer token in the Authorization header"
    invalid = "invalid API token"

    def __init__(self, keys: KeyRing | str | None) -> None:
        self.keys = keys if isinstance(keys, KeyRing) else KeyRing(token=keys)

    def key_of(self, headers: Mapping[str, str]) -> str:
        scheme, _, given = headers.get("authorization", "").partition(" ")
        return given.strip() if scheme.lower() == "bearer" else ""

    def lookup(self, given: str) -> Principal | None:
        return self.keys.identify(given)

    def principal(self, headers: Mapping[str, str]) -> Principal:
        """The principal of the key in `headers` (lower-case names); a 401 otherwise."""
        if self.keys.open:
            return LOCAL
        given = self.key_of(headers)
        if not given:
            raise ApiError(401, self.missing, code="invalid_api_key")
        principal = self.lookup(given)
        if principal is None:
            raise ApiError(401, self.invalid, code="invalid_api_key")
        return principal

    async def __call__(self, request: Request) -> None:
        principal = self.principal(request.headers)
        request.state.principal = principal
        ACTING_USER.set(principal.user)


class BearerAuth(KeyAuth):
    """The RL face's check: `Authorization: Bearer <key>`."""


class ApiKeyAuth(KeyAuth):
    """The SDKs' check (Tinker, Fireworks): `X-API-Key`, else a bearer token."""

    invalid = "invalid API key"

    def key_of(self, headers: Mapping[str, str]) -> str:
        return headers.get("x-api-key", "").strip() or super().key_of(headers)
