"""`ShardedModelResource`: a model resource whose model is sharded over the ranks, and the
checkpoint store seen by ranks other than 0."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor

from trainer.checkpoints import CheckpointRecord, CheckpointStore
from trainer.distributed.comm import Comm
from trainer.distributed.session import ShardedSession, placeholder_record
from trainer.distributed.sharding import ShardedFullPolicy, shard_model
from trainer.policy import Policy
from trainer.resource import SHARDED_DIR, ModelResource
from trainer.session import EngineOptions, TrainingSession
from trainer.specs import LoraConfig, ModelEntry, ResourceSpec, SessionSpec


class FollowerStore:
    """The checkpoint store seen by ranks ≠ 0. The catalogue lives on rank 0 only; these ranks
    write their shards into the directory rank 0 created (the writer receives its path) and
    resume from checkpoints rank 0 has verified (`known`, filled by each command)."""

    def __init__(self) -> None:
        self.known: dict[str, CheckpointRecord] = {}

    def open(self, checkpoint_id: str) -> tuple[CheckpointRecord, dict[str, Any]]:
        if checkpoint_id not in self.known:
            raise KeyError(checkpoint_id)
        return self.known[checkpoint_id], {}

    def write(self, *, writer: Callable[[Path], None], **_: Any) -> CheckpointRecord:
        writer(Path())
        return placeholder_record()


class ShardedModelResource(ModelResource):
    """A `ModelResource` whose model is sharded over the ranks of the job."""

    session_type = ShardedSession

    def __init__(
        self,
        entry: ModelEntry,
        spec: ResourceSpec,
        store: CheckpointStore,
        comm: Comm,
        options: EngineOptions | None = None,
        cpu_offload: bool = False,
    ) -> None:
        self.comm = comm
        self.cpu_offload = cpu_offload
        super().__init__(entry, spec, store, device=str(comm.device), options=options)

    def _load_model(self) -> tuple[Any, Any]:
        """Every rank reads the weights on the CPU, then keeps only its shards on the device."""
        from trainer.model import load_base_model, resolve_dtype

        model, tokenizer = load_base_model(self.entry, torch.device("cpu"))
        model.to(resolve_dtype(self.entry.dtype, self.device))
        self.root = shard_model(model, self.comm, self.cpu_offload)
        return model, tokenizer

    def _draw_seed(self) -> int:
        """Rank 0 draws, every rank uses it: replicas must agree on the session's RNG."""
        drawn = super()._draw_seed() if self.comm.rank == 0 else None
        return int(self.comm.broadcast_json(drawn))

    def _full_policy(self) -> Policy:
        return ShardedFullPolicy(self.model, self.root, with_generator=self.has_generator)

    def _new_session(
        self,
        session_id: str,
        spec: SessionSpec,
        lora_config: LoraConfig,
        seed: int | None = None,
        untie_head: bool = False,
    ) -> TrainingSession:
        session = super()._new_session(session_id, spec, lora_config, seed, untie_head)
        self._adapters_to_device()
        return session

    def _adapters_to_device(self) -> None:
        """peft puts a new adapter where the base weight's shard lives: the CPU under
        `cpu_offload`. Adapters are not FSDP's to move, so they join the compute device here."""
        with torch.no_grad():
            for param in self.model.parameters():
                if not isinstance(param, DTensor) and param.device != self.device:
                    param.data = param.data.to(self.device)

    def _restore_tensors(
        self, session: TrainingSession, path: Path, load_optimizer: bool, field: str
    ) -> None:
        """Full weights: DCP-load straight into this rank's shards, from the single-process
        files or from shards written under any world size. LoRA: replicated, as one process."""
        if not any(isinstance(p, DTensor) for p in session.policy.trainable.values()):
            super()._restore_tensors(session, path, load_optimizer, field)
            return
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

        if (path / "weights.safetensors").exists():
            directory = path
            with safe_open(str(path / "weights.safetensors"), framework="pt") as fh:
                names = set(fh.keys())
        else:
            directory = path / SHARDED_DIR
        stored = HuggingFaceStorageReader(str(directory)).read_metadata().state_dict_metadata
        if directory != path:
            names = {key for key in stored if "::" not in key}
        trainable = session.policy.trainable
        if names != set(trainable):
            missing, unexpected = sorted(set(trainable) - names), sorted(names - set(trainable))
            raise ValueError(
                f"{field}: weights do not match this model "
                f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
            )
        targets: dict[str, Any] = {name: p.detach() for name, p in trainable.items()}
        slots: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
        if load_optimizer:
            for key, meta in stored.items():
                name, _, slot = key.rpartition("::")
                if name in trainable:
                    param = trainable[name]
                    value = (
                        torch.zeros(meta.size, dtype=meta.properties.dtype)  # type: ignore[union-attr]
                        if slot == "step"
                        else torch.zeros_like(param.detach())
                    )
                    slots[name][slot] = targets[key] = value
        reader = HuggingFaceStorageReader(str(directory))
        dcp.load(targets, storage_reader=reader, process_group=self.comm.control)
        for name, state in slots.items():
            session.optimizer.state[trainable[name]] = state
