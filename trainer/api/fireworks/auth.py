"""Who calls the Fireworks face: the worker's keys, sent as `X-Api-Key` (every control-plane
call of the SDK) or `Authorization: Bearer` (its healthz, hot-load and inference calls), looked
up in the `KeyRing` in constant time. A key's user is its account: `accounts/<user>`.

An account in a path that is not the caller's answers exactly as a missing object of the
caller's own account would (`not_found` of the object the path names), admins included: a
Fireworks key has one account.
"""

from __future__ import annotations

from fastapi import Request

from trainer.api.keys import LOCAL, KeyRing, Principal
from trainer.serving.errors import ApiError
from trainer.serving.users import ACTING_USER

PUBLIC_ACCOUNT = "fireworks"
"""The account whose `models` are the worker's catalogue, readable by every key."""


def key_of(headers: dict[str, str]) -> str:
    """The key a request carries: `X-Api-Key`, else a bearer token ("" if neither)."""
    given = headers.get("x-api-key", "")
    if not given:
        scheme, _, bearer = headers.get("authorization", "").partition(" ")
        given = bearer if scheme.lower() == "bearer" else ""
    return given.strip()


def identify(keys: KeyRing, headers: dict[str, str]) -> Principal:
    """The principal of the request's key; a 401 without a key in force."""
    if keys.open:
        return LOCAL
    given = key_of(headers)
    if not given:
        raise ApiError(
            401,
            "missing API key: send X-Api-Key (FIREWORKS_API_KEY) or Authorization: Bearer",
            code="invalid_api_key",
        )
    principal = keys.identify(given)
    if principal is None:
        raise ApiError(401, "invalid API key", code="invalid_api_key")
    return principal


class FireworksAuth:
    """FastAPI dependency of every `/v1/accounts/...` route: the principal goes on
    `request.state.principal` (the audit trail's user) and `ACTING_USER`."""

    def __init__(self, keys: KeyRing) -> None:
        self.keys = keys

    async def __call__(self, request: Request) -> None:
        principal = identify(self.keys, {k: v for k, v in request.headers.items()})
        request.state.principal = principal
        ACTING_USER.set(principal.user)


def principal_of(request: Request) -> Principal:
    found = getattr(request.state, "principal", None)
    return found if isinstance(found, Principal) else LOCAL


def mine(who: Principal, account: str) -> bool:
    """Whether `account` is the caller's own."""
    return account == who.user
