"""Where a resource's model lives and how its ranks talk: the two things a session is given so
that one code path serves one process and a torchrun job alike.

- `Communicator`: the few collectives the engine needs. In one process (`Solo`) they are
  identities (sums of one, `all_gather` returning `[x]`); under torchrun it is
  `trainer.distributed.comm.Comm`, the process groups.
- `Placement`: how the model is loaded, entered and exported. `Plain` keeps it whole on one
  device; `trainer.distributed.sharding.Sharded` shards it with FSDP2 and enters every compute
  through the FSDP root.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from trainer.compute.model import default_device, load_base_model
from trainer.compute.policy import FullPolicy, Policy
from trainer.contract.specs import ModelEntry

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class Communicator(Protocol):
    rank: int
    world_size: int
    device: torch.device  # where its tensor collectives take their tensors
    control: ProcessGroup | None  # the process group of its collectives (None: one process)

    def broadcast_json(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank."""

    def all_gather_json(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order."""

    def max_int(self, value: int) -> int: ...

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """In place: the sum over ranks."""

    def broadcast_(self, tensor: torch.Tensor) -> torch.Tensor:
        """In place: rank 0's tensor."""

    def barrier(self) -> None: ...


@dataclass
class Solo:
    """The communicator of one process: every collective is the identity."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    control: ProcessGroup | None = None

    def broadcast_json(self, obj: Any = None) -> Any:
        return obj

    def all_gather_json(self, obj: Any) -> list[Any]:
        return [obj]

    def max_int(self, value: int) -> int:
        return value

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def broadcast_(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def barrier(self) -> None:
        return None


class Placement(Protocol):
    @property
    def comm(self) -> Communicator: ...

    @property
    def device(self) -> torch.device:
        """Where this rank computes."""

    def load(self, entry: ModelEntry) -> tuple[Any, Any]:
        """The model (placed) and its tokenizer."""

    def run(self, model: Any, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn(model, *args, **kwargs)`, entered the way this placement computes."""

    def reshard(self) -> None:
        """Free what a forward without backward left gathered."""

    def full_policy(self, model: Any, with_generator: bool) -> Policy: ...

    def full_state(self, model: Any) -> Any:
        """A stand-in whose `state_dict()` is the full one (None: the model itself)."""


@dataclass
class Plain:
    """The whole model on one device of one process."""

    device: torch.device = field(default_factory=default_device)
    comm: Communicator = field(default_factory=Solo)

    def load(self, entry: ModelEntry) -> tuple[Any, Any]:
        return load_base_model(entry, self.device)

    def run(self, model: Any, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return fn(model, *args, **kwargs)

    def reshard(self) -> None:
        return None

    def full_policy(self, model: Any, with_generator: bool) -> Policy:
        return FullPolicy(model, with_generator=with_generator)

    def full_state(self, model: Any) -> Any:
        return None
