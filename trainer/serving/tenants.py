"""Users as the worker's records know them: the principal a request acts for, its quotas, and
what it may see. The API layer finds the principal from the request's key
(`trainer.api.keys`); everything below takes it as given.

Visibility: a user sees the objects it owns; an admin sees every object. An object made before
owners were recorded (`owner` None) is an admin's alone. Another user's object is refused
exactly as a missing one (the same 404), so nothing tells it exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer.serving.errors import ApiError

LOCAL_USER = "local"


@dataclass(frozen=True)
class Quotas:
    """A user's limits; None is unlimited."""

    max_resources: int | None = None  # live model resources the user created
    max_sessions: int | None = None  # live training sessions, both faces together
    max_storage_bytes: int | None = None  # checkpoints and payloads the user keeps


@dataclass(frozen=True)
class Principal:
    """The user a request acts for."""

    user: str
    admin: bool = False
    quotas: Quotas = field(default_factory=Quotas)

    def sees(self, owner: str | None) -> bool:
        """Whether this user may see an object owned by `owner`."""
        return self.admin or (owner is not None and owner == self.user)


LOCAL = Principal(LOCAL_USER, admin=True)
"""The one user of a worker without a keys file (its single token, or no auth)."""


QUOTA_PREFIX = "quota "
"""How every quota refusal's message starts (`over_quota`, the storage quota of a save)."""


def is_quota_refusal(message: str) -> bool:
    """Whether a failure's message is a user's quota reached (the user's to act on)."""
    return message.startswith(QUOTA_PREFIX)


def over_quota(name: str, limit: int, used: int, unit: str = "") -> ApiError:
    """A quota reached: a 429 naming the quota, its limit and the current use."""
    return ApiError(
        429,
        f"{QUOTA_PREFIX}{name} reached: {used}{unit} in use of {limit}{unit}; stop or delete "
        "something first",
        param=name,
        code="quota_exceeded",
    )
