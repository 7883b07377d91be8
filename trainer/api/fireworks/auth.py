"""Who calls the Fireworks face: the worker's keys, sent as `X-Api-Key` (every control-plane
call of the SDK) or `Authorization: Bearer` (its healthz, hot-load and inference calls), looked
up in the `KeyRing` in constant time. A key's user is its account: `accounts/<user>`.

An account in a path that is not the caller's answers exactly as a missing object of the
caller's own account would (`not_found` of the object the path names), admins included: a
Fireworks key has one account.
"""

from __future__ import annotations

from fastapi import Request

from trainer.api.auth import ApiKeyAuth
from trainer.api.keys import LOCAL, Principal

PUBLIC_ACCOUNT = "fireworks"
"""The account whose `models` are the worker's catalogue, readable by every key."""


class FireworksAuth(ApiKeyAuth):
    """FastAPI dependency of every `/v1/accounts/...` route; `principal(headers)` is also the
    job gateway's check."""

    missing = "missing API key: send X-Api-Key (FIREWORKS_API_KEY) or Authorization: Bearer"


def principal_of(request: Request) -> Principal:
    found = getattr(request.state, "principal", None)
    return found if isinstance(found, Principal) else LOCAL


def mine(who: Principal, account: str) -> bool:
    """Whether `account` is the caller's own."""
    return account == who.user
