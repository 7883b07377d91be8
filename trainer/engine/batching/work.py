"""A forward(-backward) call as the pass and the schedulers see it: the `WorkItem`, and the
narrow views of a session and its resource they use (`TrainingSession` and `ModelResource` are
what fills them). Nothing here imports the rest of the engine, so the pass, the schedulers and
the handles can all name these types without importing each other.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from trainer.compute.batch import LossNorm, MicroBatch, PreparedSample, loss_norm
from trainer.compute.losses import LossInputs, LossOutputs
from trainer.compute.rounds import Outputs, Sums, new_sums

if TYPE_CHECKING:
    from trainer.compute.placement import Communicator, Placement
    from trainer.compute.policy import Policy
    from trainer.compute.turns import TurnLock
    from trainer.contract.options import EngineOptions


class SharingResource(Protocol):
    """What a pass and the eligibility of a call read of the resource (`ModelResource`)."""

    @property
    def comm(self) -> Communicator: ...

    @property
    def placement(self) -> Placement: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def lock(self) -> TurnLock:
        """The compute lock operations hold."""

    @property
    def sessions(self) -> Mapping[str, SharingSession]: ...

    @property
    def model_dropout(self) -> bool:
        """Whether the model's own config has a dropout above 0 (attention dropout, ...)."""


class SharingSession(Protocol):
    """What the eligibility of a call reads of its session (`TrainingSession`)."""

    @property
    def resource(self) -> SharingResource: ...

    @property
    def policy(self) -> Policy: ...

    @property
    def options(self) -> EngineOptions: ...

    @property
    def comm(self) -> Communicator: ...

    @property
    def active(self) -> bool: ...


LossFn = Callable[[LossInputs, MicroBatch], LossOutputs]
GradStash = dict[str, torch.Tensor | None]
"""A session's accumulated gradients, set aside while a call computes its new ones."""
Result = dict[str, Any]


class PassSession(SharingSession, Protocol):
    """What a pass uses of each session in it (`TrainingSession` is one).

    `operation_scope()` is the session's own operation context (the compute lock, its RNG
    stream swapped in as the global one and kept only if the block completes): a pass of one
    call runs in it. `cpu_rng` is that CPU stream between operations: a shared pass draws the
    session's LoRA dropout masks from it and moves it on only when the call completes.
    Gradients: `stash_grads` sets the accumulated ones aside (the call's start from None),
    `widen_grads` follows each backward (16-bit weights' gradients into fp32 sums, where the
    session keeps them), `check_new_grads` raises NON_FINITE_LOSS unless the new ones are
    finite on every rank, `keep_grads` adds the new ones to the stash, `restore_grads` drops
    them for the stash."""

    cpu_rng: torch.Tensor

    @property
    def id(self) -> str: ...

    @property
    def device(self) -> torch.device: ...

    def operation_scope(self) -> contextlib.AbstractContextManager[object]: ...

    def stash_grads(self) -> GradStash: ...

    def widen_grads(self) -> None: ...

    def check_new_grads(self) -> None: ...

    def keep_grads(self, stash: GradStash, prepared: Sequence[PreparedSample]) -> None: ...

    def restore_grads(self, stash: GradStash) -> None: ...


def _unchanged(result: Result) -> Result:
    return result


@dataclass
class WorkItem:
    """One session's forward(-backward) call, waiting for (then holding) its outcome."""

    session: PassSession
    prepared: list[PreparedSample]
    fn: LossFn
    norm: LossNorm
    forward_only: bool
    return_outputs: bool
    # what the session's operation returns, from the pass's result (`TrainingSession`)
    after: Callable[[Result], Result] = _unchanged
    result: Result | None = None
    error: BaseException | None = None
    done: bool = False
    taken: bool = False  # in a group being run (`trainer.engine.batching.combine`)
    # filled during the pass
    local: list[PreparedSample] = field(default_factory=list)  # this rank's share
    batch: MicroBatch | None = None  # this round's micro-batch (None: none of its samples)
    stash: GradStash | None = None
    out: LossOutputs | None = None  # this round's loss, when finite
    failure: list[str] | None = None  # the call's first failure: [code, message]
    sums: Sums = field(default_factory=new_sums)
    outputs: Outputs = field(default_factory=dict)
    loss: float = 0.0
    rng: torch.Generator | None = None  # the session's CPU stream, for a shared pass's dropout
    reports: list[dict[str, Any]] = field(default_factory=list)  # every rank's, after the pass

    @classmethod
    def of(
        cls,
        session: PassSession,
        prepared: list[PreparedSample],
        fn: LossFn,
        forward_only: bool,
        return_outputs: bool,
        after: Callable[[Result], Result] = _unchanged,
    ) -> WorkItem:
        """A call of `session` on its validated samples, with its call-level norm."""
        norm = loss_norm(prepared)
        return cls(session, prepared, fn, norm, forward_only, return_outputs, after)

    @property
    def tokens(self) -> int:
        return sum(s.length for s in self.prepared)

    def fail(self, error: BaseException) -> None:
        if self.error is None and self.result is None:
            self.error = error

    def outcome(self) -> Result:
        """What the session's operation returns; its error if it failed."""
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.after(self.result)
