"""FSDP2 sharding of a model (per decoder layer, then a root every compute enters through),
gathering it back for exports, the full-weight policy whose published copy is sharded, and
`Sharded`: the placement (`trainer.compute.placement`) that puts all of it together for a
resource."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from trainer.compute.model import load_base_model
from trainer.compute.policy import FullPolicy, Policy
from trainer.contract.specs import ModelEntry
from trainer.distributed.comm import Comm


class ShardedRoot(nn.Module):
    """The FSDP root: `root(fn, *args)` runs `fn(model, *args)` under the root's hooks, so
    the embedding, final norm and head are gathered whatever part of the model `fn` calls."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return fn(self.model, *args, **kwargs)


def shard_model(model: nn.Module, comm: Comm, cpu_offload: bool = False) -> ShardedRoot:
    """`fully_shard` each decoder layer, then the root; gradients are reduced as sums."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        FSDPModule,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    mesh = init_device_mesh(comm.device.type, (comm.world_size,))
    mp = MixedPrecisionPolicy()
    if comm.device.type == "cuda":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    decoder = cast(Any, model).get_decoder()
    for layer in decoder.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=offload)
    root = ShardedRoot(model)
    fully_shard(root, mesh=mesh, mp_policy=mp, offload_policy=offload)
    for module in root.modules():
        if isinstance(module, FSDPModule):  # a plain SUM (gloo has no PREMUL_SUM)
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return root


def reshard(root: ShardedRoot) -> None:
    """Free the root's gathered parameters. FSDP keeps the root gathered after a forward
    (for the backward); after a forward without backward they would go stale once the
    sharded weights change (optimizer step, resume, published swap)."""
    cast(Any, root).reshard()


def gather_full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's full state dict on rank 0's CPU (empty elsewhere). Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return cast(dict[str, torch.Tensor], get_model_state_dict(model, options=options))


class GatheredModel:
    """A stand-in for the model whose `state_dict()` is the gathered full one (for exports)."""

    def __init__(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        self._model = model
        self._state = state

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._state

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


class ShardedFullPolicy(FullPolicy):
    """Full weights, sharded. The published weights are a sharded copy (1/N of the model per
    rank) swapped into the live parameters while sampling, not a second model."""

    def __init__(self, model: Any, root: ShardedRoot, with_generator: bool) -> None:
        super().__init__(model, with_generator=False)
        self._root = root
        self._published = self.snapshot() if with_generator else None

    @contextlib.contextmanager
    def published(self) -> Iterator[nn.Module]:
        if self._published is None:
            raise RuntimeError("this resource has no generator")
        live = self.snapshot()
        self._copy_in(self._published)
        self._model.eval()
        try:
            yield self._model
        finally:
            reshard(self._root)  # the gathered root holds published weights
            self._copy_in(live)

    def _copy_in(self, tensors: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, param in self.trainable.items():
                param.copy_(tensors[name])

    def published_tensors(self) -> dict[str, torch.Tensor]:
        return {} if self._published is None else dict(self._published)

    def publish(self, snapshot: dict[str, torch.Tensor] | None = None) -> None:
        if self._published is None:
            return
        source = snapshot if snapshot is not None else self.trainable
        with torch.no_grad():
            for name, tensor in self._published.items():
                tensor.copy_(source[name])

    def close(self) -> None:
        super().close()
        self._published = None


@dataclass
class Sharded:
    """The model sharded with FSDP2 over the ranks of `comm` (see `trainer.compute.placement`).
    Every
    rank reads the weights on the CPU, in the compute dtype, with the attention of the compute
    device (flash-attention on CUDA when installed, else the exact packed SDPA), then keeps
    only its shards on the device."""

    comm: Comm
    cpu_offload: bool = False
    root: ShardedRoot | None = None

    @property
    def device(self) -> torch.device:
        return self.comm.device

    def load(self, entry: ModelEntry) -> tuple[Any, Any]:
        model, tokenizer = load_base_model(entry, self.device, load_on=torch.device("cpu"))
        self.root = shard_model(model, self.comm, self.cpu_offload)
        return model, tokenizer

    def _root(self) -> ShardedRoot:
        if self.root is None:
            raise RuntimeError("the model is not loaded")
        return self.root

    def run(self, model: Any, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self._root()(fn, *args, **kwargs)

    def reshard(self) -> None:
        reshard(self._root())

    def full_policy(self, model: Any, with_generator: bool) -> Policy:
        return ShardedFullPolicy(model, self._root(), with_generator=with_generator)

    def full_state(self, model: Any) -> Any:
        return GatheredModel(model, gather_full_state(model))
