"""The checkpoint store seen by ranks other than 0."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer.checkpoint.layout import placeholder_record
from trainer.checkpoint.store import CheckpointRecord


class FollowerCheckpoints:
    """The catalogue lives on rank 0 only; these ranks write their shards into the directory
    rank 0 created (the writer receives its path) and resume from checkpoints rank 0 has
    verified (`known`, filled by each command)."""

    def __init__(self) -> None:
        self.known: dict[str, CheckpointRecord] = {}
        # no storage root of its own (rank 0 has it): whatever these ranks would keep beside
        # checkpoints (run logs) goes under the working directory
        self.root = Path(".")

    def open(self, checkpoint_id: str) -> tuple[CheckpointRecord, dict[str, Any]]:
        if checkpoint_id not in self.known:
            raise KeyError(checkpoint_id)
        return self.known[checkpoint_id], {}

    def write(self, *, writer: Callable[[Path], None], **_: Any) -> CheckpointRecord:
        writer(Path())
        return placeholder_record()
