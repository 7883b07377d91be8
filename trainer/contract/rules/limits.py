"""What the rules read and check against: the request shapes they accept (protocols that the
RL face's pydantic specs and the Tinker face's parsed bodies both satisfy), a served model's
`Limits`, and a loss's `Needs` (from the loss registry, `trainer.contract.losses`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Sized
from dataclasses import dataclass
from typing import Any, Protocol

from trainer.contract.arrays import IntArray, NumArray
from trainer.contract.losses import LOSS_SPECS, InputRule


class Tensor(Protocol):
    """A `loss_fn_inputs` value: `TensorData`, or what the Tinker face parsed."""

    @property
    def dtype(self) -> str: ...

    @property
    def data(self) -> Sequence[Any] | NumArray: ...

    @property
    def shape(self) -> Sequence[int] | None:
        """None or `[len(data)]`: one value per token; `[T, K]`: soft targets (flat data)."""


class Tokens(Protocol):
    """A model input (`ModelInput`): its token ids, listed or packed, and how many each of its
    chunks holds."""

    @property
    def tokens(self) -> list[int]: ...

    def token_array(self) -> IntArray: ...

    def chunk_lengths(self) -> list[int]: ...


class SampleLike(Protocol):
    """One sample of a forward-backward (`Sample`)."""

    @property
    def model_input(self) -> Tokens: ...

    @property
    def loss_fn_inputs(self) -> Mapping[str, Tensor]: ...


class GradientLike(Protocol):
    """One sample's per-token gradients (`Gradient`)."""

    @property
    def data(self) -> Sized: ...


class ModelLimits(Protocol):
    """The limits of a served model (`ModelEntry`)."""

    @property
    def name(self) -> str: ...

    @property
    def max_seq_length(self) -> int: ...

    @property
    def max_batch_size(self) -> int: ...

    @property
    def max_tokens_per_call(self) -> int: ...


@dataclass(frozen=True)
class Limits:
    """What a request is checked against: the model's limits and, where it is known (the
    engine), the vocabulary."""

    max_seq_length: int
    max_batch_size: int
    max_tokens_per_call: int | None = None  # None: the call's token total is not checked
    vocab_size: int | None = None  # None: token ids are only checked to be >= 0
    model: str = ""  # the model's name, in the messages

    @classmethod
    def of(cls, entry: ModelLimits, vocab_size: int | None = None) -> Limits:
        return cls(
            entry.max_seq_length,
            entry.max_batch_size,
            entry.max_tokens_per_call,
            vocab_size,
            entry.name,
        )

    @property
    def of_model(self) -> str:
        return f" of {self.model}" if self.model else ""


@dataclass(frozen=True)
class Needs:
    """The inputs every sample of a call carries: `target_tokens`, `required`, and those of the
    `rules` that apply; `by` says who needs them ("loss LOSS_TYPE_PPO"; None: unsaid).
    `soft_targets`: `target_tokens` and `weights` may be [T, K] (the loss's `LossSpec`)."""

    required: tuple[str, ...] = ()
    rules: tuple[InputRule, ...] = ()
    by: str | None = "this loss"
    soft_targets: bool = False

    @classmethod
    def of_loss(cls, loss_type: str, params: Any, by: str | None = None) -> Needs:
        """What `loss_type` with these parsed params needs, from the registry."""
        spec = LOSS_SPECS[loss_type]
        return cls(
            spec.required, spec.rules_for(params), by or f"loss {loss_type}", spec.soft_targets
        )
