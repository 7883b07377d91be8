"""What a forward(-backward) pass uses of a session's gradients (`batching/work.py`:
`PassSession`): the new ones kept apart until they are known to be finite, and the counts
`optim_step` normalizes by. `TrainingSession` is one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from trainer.compute import optim
from trainer.compute.batch import PreparedSample
from trainer.engine.batching.work import GradStash

if TYPE_CHECKING:
    from trainer.compute.placement import Communicator
    from trainer.compute.policy import Policy


class GradKeeping:
    """The gradient half of a session (module docstring)."""

    optimizer: torch.optim.Optimizer
    policy: Policy
    accumulated_tokens: int  # `TrainingSession`'s counters
    accumulated_sequences: int

    @property
    def comm(self) -> Communicator:
        raise NotImplementedError

    # With masters, a 16-bit weight's gradient is an fp32 sum the optimizer holds in place of
    # `.grad` (`optim.wide_grads`, docs/semantics.md §7): stashed, widened after each
    # micro-batch's backward, checked, kept and restored alike. A stashed tensor of another
    # dtype than its weight's is such a sum.

    def stash_grads(self) -> GradStash:
        wide = optim.wide_grads(self.optimizer) or {}
        stash = {}
        for name, param in self.policy.trainable.items():
            stash[name] = wide.pop(param) if param in wide else param.grad
            param.grad = None
        return stash

    def widen_grads(self) -> None:
        optim.accumulate_(self.optimizer, self.policy.trainable.values())

    def check_new_grads(self) -> None:
        params = list(self.policy.trainable.values())
        optim.check_finite_grads(optim.step_grads(self.optimizer, params), self.comm)

    def restore_grads(self, stash: GradStash) -> None:
        wide = optim.wide_grads(self.optimizer)
        for name, param in self.policy.trainable.items():
            old, param.grad = stash[name], None
            if wide is not None:
                wide.pop(param, None)
            if old is not None and old.dtype != param.dtype:
                assert wide is not None
                wide[param] = old
            else:
                param.grad = old

    def keep_grads(self, stash: GradStash, prepared: Sequence[PreparedSample] = ()) -> None:
        # what the last backward left in `.grad`, if anything
        optim.accumulate_(self.optimizer, self.policy.trainable.values())
        wide = optim.wide_grads(self.optimizer)
        for name, param in self.policy.trainable.items():
            old = stash[name]
            if old is None:
                continue
            if old.dtype != param.dtype:
                assert wide is not None
                new = wide.get(param)
                wide[param] = old if new is None else old.add_(new)
            else:
                param.grad = old if param.grad is None else old.add_(param.grad)
        for sample in prepared:  # every call's samples (every rank counts them all)
            tokens = int((sample.mask_T != 0).sum())
            self.accumulated_tokens += tokens
            self.accumulated_sequences += tokens > 0

    def grad_scale(self, normalization: str | None) -> float:
        """What `optim_step` multiplies the accumulated gradients by (docs/semantics.md §23):
        1 / the loss tokens (`num_loss_tokens`) or the sequences (`num_sequences`) accumulated
        since the last step; 1 for None or when there are none."""
        count = {
            "num_loss_tokens": self.accumulated_tokens,
            "num_sequences": self.accumulated_sequences,
        }.get(normalization or "", 0)
        return 1.0 / count if count > 0 else 1.0
