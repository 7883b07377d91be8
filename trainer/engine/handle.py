"""The narrow handle a session holds on its resource: it sees `ResourceHandle`, never
`ModelResource`, so neither module imports the other."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from trainer.engine.batching.work import SharingResource

if TYPE_CHECKING:
    import torch

    from trainer.checkpoint.store import CheckpointStore
    from trainer.contract.specs import ModelEntry, ResourceSpec
    from trainer.engine.batching.pass_scheduler import PassScheduler
    from trainer.engine.replicas import ReplicaPool


class ResourceHandle(SharingResource, Protocol):
    """What a session uses of its resource (`ModelResource`): what a pass reads of it
    (`SharingResource`), and the rest below."""

    entry: ModelEntry
    spec: ResourceSpec
    tokenizer: Any  # the model's transformers tokenizer (None: the model has none)
    vocab_size: int
    hidden_size: int  # the width of the decoder's last hidden state
    eos_ids: set[int]
    has_generator: bool
    replicas: ReplicaPool | None  # the vLLM replicas serving its samples, if it runs some
    # the batcher of concurrent samples (`sample_batch.SampleBatcher`, which this module does
    # not import: it sits above it), made by the first sample that may join one
    sample_batcher: object | None

    @property
    def store(self) -> CheckpointStore:
        """The checkpoint catalogue (`FollowerCheckpoints` on ranks ≠ 0, which lists nothing)."""

    @property
    def scheduler(self) -> PassScheduler:
        """Runs the forward(-backward) calls of its sessions, shared passes where they may."""

    def export_dtype(self, name: str) -> torch.dtype:
        """The dtype a merged model is written in at export precision `name`."""
