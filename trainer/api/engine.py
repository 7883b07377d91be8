"""What the HTTP layer needs from the training engine, as structural types.

The real implementation is `trainer.resource.ModelResource` / `trainer.session.TrainingSession`;
the worker only sees these protocols, so the HTTP layer can be read (and type-checked) on its
own, and the engine is picked in one place (`load_resource`).
"""

from __future__ import annotations

from typing import Any, Protocol

from trainer.checkpoints import CheckpointRecord, CheckpointStore
from trainer.specs import (
    AdamParams,
    Gradient,
    LossConfig,
    ModelEntry,
    ModelInput,
    ResourceSpec,
    Sample,
    SamplingParams,
    SessionSpec,
)


class EngineSession(Protocol):
    id: str

    @property
    def step(self) -> int: ...

    def policy_state(self) -> dict[str, Any]: ...

    def forward_backward(
        self,
        loss: LossConfig,
        samples: list[Sample],
        *,
        forward_only: bool = False,
        return_loss_fn_outputs: bool = False,
    ) -> dict[str, Any]: ...

    def custom_forward_backward(
        self, samples: list[Sample], gradients: list[Gradient]
    ) -> dict[str, Any]: ...

    def optim_step(self, adam: AdamParams) -> dict[str, Any]: ...

    def weights_sync(self, sync_type: str) -> dict[str, Any]: ...

    def sample(
        self,
        model_inputs: list[ModelInput],
        *,
        num_samples: int,
        sampling_params: SamplingParams,
        prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
    ) -> dict[str, Any]: ...

    def save_training_checkpoint(self) -> CheckpointRecord: ...

    def save_inference_checkpoint(self) -> CheckpointRecord: ...


class EngineResource(Protocol):
    lora: bool

    def create_session(self, session_id: str, spec: SessionSpec) -> EngineSession: ...

    def close_session(self, session_id: str) -> None: ...

    def close(self) -> None: ...


def load_resource(
    entry: ModelEntry, spec: ResourceSpec, store: CheckpointStore, device: str | None
) -> EngineResource:
    """Load a model for a resource (slow, blocking: call it from a worker thread)."""
    from trainer.resource import ModelResource

    resource: EngineResource = ModelResource(entry, spec, store, device=device)
    return resource
