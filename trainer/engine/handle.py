"""The narrow handle a session holds on its resource: it sees `ResourceHandle`, never
`ModelResource`, so neither module imports the other."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from trainer.compute.placement import Communicator, Placement
    from trainer.contract.specs import ModelEntry, ResourceSpec


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
