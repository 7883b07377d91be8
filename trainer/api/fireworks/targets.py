"""What a completion samples: its `model` resolved to an engine session of this worker.

A completion's `model` names a deployment (`accounts/<a>/deployments/<d>`), a promoted model
(`accounts/<a>/models/<m>`) or a checkpoint of any face. Each kind has a resolver
(`Resolver`), registered on the face's `Targets`; the first that knows the name answers. A
resolver raises the `ApiError` the name deserves (404 for a missing name or another account's,
exactly alike; 425 while a deployment loads the weights it would serve; 400 naming `model`),
and returns None for a name that is not of its kind.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from trainer.serving.errors import ApiError
from trainer.serving.tenants import Principal


@dataclass
class Target:
    """An engine session whose `sample` operation serves a completion: its base model (the
    catalogue entry's name), what it serves (`identity`: a checkpoint path; None: the base
    model) and `release`, called once the completion is done (the session may close after)."""

    name: str
    base_model: str
    session_id: str
    identity: str | None = None
    release: Callable[[], None] = field(default=lambda: None)


Resolver = Callable[[str, Principal], Target | None]


class Targets:
    """The resolvers of completion models, tried in the order they were registered."""

    def __init__(self) -> None:
        self.resolvers: list[Resolver] = []

    def register(self, resolver: Resolver) -> None:
        self.resolvers.append(resolver)

    def resolve(self, name: str, who: Principal) -> Target:
        """The target `name` names for `who` (blocking: it may open an engine session)."""
        for resolver in self.resolvers:
            target = resolver(name, who)
            if target is not None:
                return target
        raise ApiError(404, f"model: {name!r} not found", param="model", code="not_found")
