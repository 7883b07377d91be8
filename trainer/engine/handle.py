"""The narrow handles the engine's parts hold on each other, so that none imports the other:
a session sees of its resource only `ResourceHandle` (not `ModelResource`), and the checkpoint
layout sees of a session only `SessionState` (not `TrainingSession`)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from trainer.compute.placement import Communicator, Placement
    from trainer.compute.policy import Policy
    from trainer.contract.specs import ModelEntry, ResourceSpec, SessionSpec


class ResourceHandle(Protocol):
    """What a session uses of its resource."""

    entry: ModelEntry
    spec: ResourceSpec
    store: Any  # the checkpoint catalogue (`CheckpointStore`; `FollowerStore` on ranks ≠ 0)
    lock: Any  # the compute lock operations hold
    device: torch.device
    comm: Communicator
    placement: Placement
    tokenizer: Any
    vocab_size: int
    eos_ids: set[int]
    has_generator: bool


class SessionState(Protocol):
    """What a checkpoint holds of a session, and how to read it back into one."""

    resource: ResourceHandle
    spec: SessionSpec
    policy: Policy
    optimizer: torch.optim.Optimizer
    rng_seed: int
    step: int
    versions: Any  # `session_generator.Versions`

    @property
    def comm(self) -> Communicator: ...

    def _running(self) -> contextlib.AbstractContextManager[Any]: ...

    def rng_tensors(self) -> dict[str, torch.Tensor]: ...

    def restore_rng(self, tensors: dict[str, torch.Tensor]) -> None: ...
