"""What the HTTP layer needs from the training engine, as structural types.

The real implementation is `trainer.engine.resource.ModelResource` /
`trainer.engine.session.TrainingSession`;
the worker only sees these protocols, so the HTTP layer can be read (and type-checked) on its
own, and the engine is picked in one place (`load_resource`).
"""

from __future__ import annotations

from typing import Any, Protocol

from trainer.checkpoint.store import CheckpointStore
from trainer.contract.options import EngineOptions
from trainer.contract.specs import LoraConfig, ModelEntry, ResourceSpec, SessionSpec


class EngineSession(Protocol):
    id: str

    @property
    def step(self) -> int: ...

    def policy_state(self) -> dict[str, Any]: ...

    @property
    def lora_config(self) -> LoraConfig | None:
        """The LoRA config it trains with (a resumed checkpoint's own); None: full weights."""

    # the operations (forward_backward, optim_step, ...) are called by name from the operation
    # table, `trainer.serving.operations.OPERATIONS`, each with its own arguments


class EngineResource(Protocol):
    lora: bool

    def create_session(self, session_id: str, spec: SessionSpec) -> EngineSession: ...

    def close_session(self, session_id: str) -> None: ...

    def counters(self) -> dict[str, int]: ...

    def generator_status(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


def load_resource(
    entry: ModelEntry,
    spec: ResourceSpec,
    store: CheckpointStore,
    device: str | None,
    options: EngineOptions | None = None,
) -> EngineResource:
    """Load a model for a resource (slow, blocking: call it from a worker thread)."""
    from trainer.engine.resource import ModelResource

    resource: EngineResource = ModelResource(entry, spec, store, device=device, options=options)
    return resource
