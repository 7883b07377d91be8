"""Who sent a Tinker request and what it asked: the identity that maps a retry to its future.

A request belongs to an owner (a model `<session>:train:<seq>`, a sampling session
`<session>:sample:<seq>`, or an ad-hoc sampling target `adhoc:<user>:<path or base model>`,
its user's own), and what it asked is the sha256 of its body (`body_digest`). A future is
found by its key among its own user's futures only (`TinkerBridge.future`).
- With `X-Idempotency-Key` (the SDK sends one per request and reuses it across its retries):
  the owner, the route and the key name the future; the same key with another body is a 409
  naming the header, and the same key on another owner or route is another request.
- Without it, the owner, the kind, `seq_id` and the body's hash do: a retry of the same
  request gets its future, and two clients that send other bodies under the same owner and
  `seq_id` (two ad-hoc samples of one base model, say) each get their own.
- Without either (no `seq_id`), none: every such request runs (two seq-less optim steps are
  two steps).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi import Request
from pydantic import BaseModel

from trainer.api.tinker.records import TinkerFuture
from trainer.serving.errors import ApiError, bad_request

KEY_HEADER = "X-Idempotency-Key"
MAX_KEY_LENGTH = 256


@dataclass(frozen=True)
class RequestKey:
    """`key` names the request's future (None: a new future each time); `digest` is its
    body's hash; `field` is what a conflicting reuse is reported under."""

    key: str | None
    digest: str
    field: str = KEY_HEADER

    def same(self, existing: TinkerFuture) -> TinkerFuture:
        """`existing` (the future `key` names) if it was made by this very request; a 409
        naming `field` if another body made it."""
        if existing.body_hash is not None and existing.body_hash != self.digest:
            raise ApiError(
                409,
                f"{self.field}: already used for a different request (another body) on "
                f"{existing.model_id}; use a new {self.field} for a new request",
                param=self.field,
                code="idempotency_key_reused",
            )
        return existing


def _canonical(value: Any) -> Any:
    """JSON for what `json.dumps` cannot write: an array as its dtype, shape and sha256."""
    if isinstance(value, np.ndarray):
        data = np.ascontiguousarray(value)
        return {
            "array": data.dtype.str,
            "shape": list(data.shape),
            "sha256": hashlib.sha256(data.tobytes()).hexdigest(),
        }
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def body_digest(kind: str, body: Any) -> str:
    """The sha256 of a request's body (canonical JSON: sorted keys, arrays by their bytes; a
    validated body by its fields, defaults included)."""
    if isinstance(body, BaseModel):
        body = body.model_dump(mode="json")
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), default=_canonical)
    return hashlib.sha256(f"{kind}\n{canonical}".encode()).hexdigest()


def header_key(request: Request) -> str:
    """The request's `X-Idempotency-Key` ('' when absent); a 400 naming it past 256 chars."""
    header = request.headers.get(KEY_HEADER.lower(), "").strip()
    if len(header) > MAX_KEY_LENGTH:
        raise bad_request(
            f"{KEY_HEADER}: at most {MAX_KEY_LENGTH} characters, got {len(header)}", KEY_HEADER
        )
    return header


def request_key(
    request: Request, owner: str, kind: str, seq_id: int | str | None, body: Any
) -> RequestKey:
    """The identity of a request of `owner` (see the module docstring). `seq_id` may be any
    per-request id of the owner (None: the request has none)."""
    header = header_key(request)
    digest = body_digest(kind, body)
    if header:
        return RequestKey(f"{owner}|{request.url.path}|key:{header}", digest)
    if seq_id is None:
        return RequestKey(None, digest)
    return RequestKey(f"{owner}|{kind}|seq:{seq_id}|{digest}", digest)
