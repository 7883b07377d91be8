"""Bearer-token check for every `/v1/rl/...` route (constant-time; the token is never logged)."""

from __future__ import annotations

import hmac

from fastapi import Request

from trainer.serving.errors import ApiError


class BearerAuth:
    """FastAPI dependency: `Authorization: Bearer <token>` must match; `None` disables auth."""

    def __init__(self, token: str | None) -> None:
        self._token = token.encode() if token is not None else None

    async def __call__(self, request: Request) -> None:
        if self._token is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise ApiError(
                401, "missing bearer token in the Authorization header", code="invalid_api_key"
            )
        if not hmac.compare_digest(given.strip().encode(), self._token):
            raise ApiError(401, "invalid API token", code="invalid_api_key")
