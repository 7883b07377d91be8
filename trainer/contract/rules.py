"""The rulebook: every check of a request's content, written once.

Each rule refuses with an `InputError` naming the field by the path its caller gives, so every
face says it in its own names and nothing else differs:
- the HTTP edge (`trainer.serving.requests`) runs them before an operation is queued, against
  the model's limits and, once a resource of the model has loaded, its vocabulary (before
  that, token ids are checked to be >= 0);
- the engine (`trainer.compute.batch.prepare_samples`, the generator's `_check_prompts`) runs
  them again with the vocabulary, for callers that reach it without the edge;
- the Tinker face (`trainer.api.tinker.convert`) runs them, the vocabulary included, under its
  names (`forward_backward_input.data[3]` for the RL face's `samples[3]`).

A bad token id is named by its chunk and its place in it (`token_field`).

Which inputs a loss reads, and their dtypes, come from the loss registry
(`trainer.contract.losses`). Numpy only (no torch), so the edge can run every rule.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence, Sized
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from trainer.contract.arrays import INT64_MAX, IntArray, NumArray, first
from trainer.contract.errors import InputError
from trainer.contract.losses import (
    LOSS_INPUTS,
    LOSS_SPECS,
    MAX_TARGET_COLUMNS,
    SOFT_INPUTS,
    InputRule,
)

MAX_TOPK_PROMPT_LOGPROBS = 20


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


# --------------------------------------------------------------------------------------------
# Values
# --------------------------------------------------------------------------------------------


def check_finite(values: Sequence[float] | NumArray, field: str) -> None:
    """`{field}[k]: is not finite` for the first NaN or infinity, in the values sent or once
    they are float32 (as every float input and gradient is computed with): 1e39 is refused too.
    Integer arrays always pass."""
    array = np.asarray(values)
    if array.dtype.kind not in "iu":
        array = array.astype(np.float64, copy=False)
        if (k := first(~np.isfinite(array))) is not None:
            raise InputError(f"{field}[{k}]", "is not finite")
        with np.errstate(over="ignore"):
            narrowed = array.astype(np.float32)
        if (k := first(~np.isfinite(narrowed))) is not None:
            raise InputError(
                f"{field}[{k}]", f"{float(array[k])!r} is not finite in float32 (|x| over 3.4e38)"
            )


def token_values(model_input: Tokens) -> IntArray | list[int]:
    """The ids of a model input: one int64 array, or the list when an id is past int64 (which
    `check_ids` then refuses by its position)."""
    try:
        return model_input.token_array()
    except OverflowError:
        return model_input.tokens


def check_ids(
    values: Sequence[int] | NumArray,
    field: str | Callable[[int], str],
    vocab_size: int | None = None,
) -> IntArray:
    """Token ids as a fresh int64 array (never aliasing the request). `{field}[k]` names the
    first that is negative or, with a vocabulary, not below `vocab_size` (`field(k)` where
    `field` maps a position to its name)."""
    try:
        ids = np.array(values, dtype=np.int64)
    except OverflowError:  # a Python int past int64: negative ones stay negative
        ids = np.array([max(min(int(t), INT64_MAX), -1) for t in values], dtype=np.int64)
    bad = first(ids < 0) if vocab_size is None else first((ids < 0) | (ids >= vocab_size))
    if bad is not None:
        value = values[bad]
        where = field(bad) if callable(field) else f"{field}[{bad}]"
        if vocab_size is None:
            raise InputError(where, f"negative token id {value}")
        raise InputError(where, f"token id {value} out of range [0, {vocab_size})")
    return ids


def token_field(model_input: Tokens, field: str) -> Callable[[int], str]:
    """Position k of the model input's tokens -> its field,
    `{field}.chunks[j].encoded_text.tokens[i]` (token i of chunk j)."""
    ends = np.cumsum(model_input.chunk_lengths())

    def name(k: int) -> str:
        j = int(np.searchsorted(ends, k, side="right"))
        start = int(ends[j - 1]) if j else 0
        return f"{field}.chunks[{j}].encoded_text.tokens[{k - start}]"

    return name


def check_has_tokens(count: int, field: str) -> None:
    if count == 0:
        raise InputError(field, "has no tokens")


# --------------------------------------------------------------------------------------------
# Samples of a forward-backward
# --------------------------------------------------------------------------------------------


def check_count(count: int, limits: Limits, field: str = "samples") -> None:
    if count == 0:
        raise InputError(field, "at least one sample is required")
    if count > limits.max_batch_size:
        raise InputError(
            field,
            f"{count} samples exceed max_batch_size {limits.max_batch_size}{limits.of_model}",
        )


def check_model_input(
    tokens: Sequence[int] | NumArray,
    field: str,
    limits: Limits,
    model_input: Tokens | None = None,
) -> IntArray:
    """A sample's tokens: some, at most `max_seq_length`, each id in range; a bad id is named
    by its chunk and place in it (`token_field`; `{field}.chunks[0].encoded_text.tokens[k]`
    without the model input)."""
    check_has_tokens(len(tokens), field)
    if len(tokens) > limits.max_seq_length:
        raise InputError(
            field, f"{len(tokens)} tokens exceed max_seq_length {limits.max_seq_length}"
        )
    where = (
        token_field(model_input, field)
        if model_input is not None
        else f"{field}.chunks[0].encoded_text.tokens"
    )
    return check_ids(tokens, where, limits.vocab_size)


def _missing(field: str, by: str | None, reason: str = "") -> InputError:
    words = ("is required", f"by {by}" if by else "", reason)
    return InputError(field, " ".join(word for word in words if word))


def check_conditional(
    where: str, present: Collection[str], rules: Sequence[InputRule], by: str | None = None
) -> None:
    """The inputs a loss needs only with its params (`LossSpec.rules_for`), of sample `where`."""
    for rule in rules:
        if rule.input not in present:
            raise _missing(f"{where}.loss_fn_inputs.{rule.input}", by, rule.reason)


def check_inputs(
    where: str,
    length: int,
    inputs: Mapping[str, Tensor],
    needs: Needs,
    vocab_size: int | None = None,
) -> IntArray:
    """The `loss_fn_inputs` of sample `where` (`length` tokens): what `needs` names is there,
    not both `weights` and `mask`, each input in a dtype of the registry and with one value per
    token (or, for soft targets, one row of K per token: `check_soft_targets`), and target ids
    in range. Returns the target ids (int64), shaped [T] or [T, K]."""
    field = f"{where}.loss_fn_inputs"
    for name in ("target_tokens", *needs.required):
        if name not in inputs:
            raise _missing(f"{field}.{name}", needs.by)
    check_conditional(where, inputs, needs.rules, needs.by)
    if "weights" in inputs and "mask" in inputs:
        raise InputError(field, "weights and mask are mutually exclusive")
    columns = check_soft_targets(field, length, inputs, needs)
    for name, tensor in inputs.items():
        known = LOSS_INPUTS.get(name)
        if known is not None and tensor.dtype not in known.dtypes:
            raise InputError(f"{field}.{name}.dtype", f"must be one of {list(known.dtypes)}")
        if len(_shape(tensor)) == 1 and len(tensor.data) != length:
            raise InputError(
                f"{field}.{name}", f"has {len(tensor.data)} values for {length} model_input tokens"
            )
    name = f"{field}.target_tokens"
    if columns is None:
        return check_ids(inputs["target_tokens"].data, name, vocab_size)
    ids = check_ids(inputs["target_tokens"].data, _cell(name, columns), vocab_size)
    return ids.reshape(length, columns)


def _shape(tensor: Tensor) -> list[int]:
    shape = getattr(tensor, "shape", None)
    return [len(tensor.data)] if shape is None else [int(n) for n in shape]


def _cell(field: str, columns: int) -> Callable[[int], str]:
    """Flat index k of a [T, K] tensor -> `{field}[t][j]`."""
    return lambda k: f"{field}[{k // columns}][{k % columns}]"


def check_soft_targets(
    field: str, length: int, inputs: Mapping[str, Tensor], needs: Needs
) -> int | None:
    """K when the sample sends [T, K] soft targets, else None (every input is [T]).

    Only a loss with `soft_targets` (cross entropy) takes them, and only as `target_tokens`
    and `weights`, both [T, K] (`weights` may be omitted where the loss does not require it),
    with T the model input's length and 1 ≤ K ≤ `MAX_TARGET_COLUMNS`; any other input
    stays [T]. A refusal names the tensor's `shape`."""
    shapes = {name: _shape(tensor) for name, tensor in inputs.items()}
    two_d = [name for name, shape in shapes.items() if len(shape) != 1]
    if not two_d:
        return None
    for name in two_d:
        where, shape = f"{field}.{name}.shape", shapes[name]
        if len(shape) != 2:
            raise InputError(where, f"{shape} is neither [T] nor [T, K]")
        if not needs.soft_targets or name not in SOFT_INPUTS:
            raise InputError(
                where,
                f"{shape} must be [{length}] (1-D): only cross entropy's target_tokens and "
                "weights take [T, K]",
            )
        rows, columns = shape
        if rows != length:
            raise InputError(where, f"{shape} has {rows} rows for {length} model_input tokens")
        if not 1 <= columns <= MAX_TARGET_COLUMNS:
            raise InputError(
                where,
                f"{shape}: K = {columns} targets per position, not in [1, {MAX_TARGET_COLUMNS}]",
            )
        if len(inputs[name].data) != rows * columns:
            raise InputError(
                f"{field}.{name}", f"has {len(inputs[name].data)} values for shape {shape}"
            )
    target, weights = shapes["target_tokens"], shapes.get("weights")
    if weights is not None and weights != target:
        raise InputError(
            f"{field}.weights.shape",
            f"{weights} does not match target_tokens' {target}: [T, K] soft targets take "
            "target_tokens and weights of one shape",
        )
    return target[1] if len(target) == 2 else None


def check_same_columns(columns: list[int | None], field: Callable[[int], str]) -> None:
    """Every sample of a call sends its targets in one shape: all [T] (None), or all [T, K]
    with the same K (`field(i)`: sample i's `target_tokens`)."""

    def said(k: int | None) -> str:
        return "[T] (1-D)" if k is None else f"[T, {k}]"

    for i, k in enumerate(columns):
        if k != columns[0]:
            raise InputError(
                f"{field(i)}.shape",
                f"is {said(k)} where the call's first sample's is {said(columns[0])}: every "
                "sample of a call sends target_tokens of one shape",
            )


def check_gradient_count(count: int, samples: int) -> None:
    if count != samples:
        raise InputError("gradients", f"has {count} entries for {samples} samples (one each)")


def check_gradient(i: int, gradient: GradientLike, length: int) -> None:
    if len(gradient.data) != length:
        raise InputError(
            f"gradients[{i}].data",
            f"has {len(gradient.data)} values for the {length} tokens of samples[{i}]",
        )


def check_samples(
    samples: Sequence[SampleLike],
    limits: Limits,
    needs: Needs,
    gradients: Sequence[GradientLike] | None = None,
) -> list[tuple[IntArray, IntArray]]:
    """A forward-backward's samples (and a custom one's gradients): their count and token
    total, then each sample's tokens and inputs. Returns each sample's token and target ids."""
    check_count(len(samples), limits)
    if gradients is not None:
        check_gradient_count(len(gradients), len(samples))
    tokens = [token_values(sample.model_input) for sample in samples]
    budget = limits.max_tokens_per_call
    if budget is not None and (total := sum(len(t) for t in tokens)) > budget:
        raise InputError(
            "samples",
            f"{total} tokens in all exceed max_tokens_per_call {budget}{limits.of_model}; "
            "split the call",
        )
    checked = []
    for i, sample in enumerate(samples):
        field = f"samples[{i}].model_input"
        ids = check_model_input(tokens[i], field, limits, sample.model_input)
        targets = check_inputs(
            f"samples[{i}]", len(ids), sample.loss_fn_inputs, needs, limits.vocab_size
        )
        if gradients is not None:
            check_gradient(i, gradients[i], len(ids))
        checked.append((ids, targets))
    columns = [int(t.shape[1]) if t.ndim == 2 else None for _, t in checked]
    check_same_columns(columns, lambda i: f"samples[{i}].loss_fn_inputs.target_tokens")
    return checked


# --------------------------------------------------------------------------------------------
# Prompts of a sample call
# --------------------------------------------------------------------------------------------


def check_num_samples(num_samples: int, field: str = "num_samples") -> None:
    if num_samples < 1:
        raise InputError(field, "must be at least 1")


def check_topk(topk: int, field: str = "topk_prompt_logprobs") -> None:
    if not 0 <= topk <= MAX_TOPK_PROMPT_LOGPROBS:
        raise InputError(field, f"must be in [0, {MAX_TOPK_PROMPT_LOGPROBS}]")


def check_last_n(
    last_n: int | None,
    prompt_lengths: Sequence[int],
    prompt_logprobs: bool,
    field: str = "prompt_logprobs_last_n",
) -> None:
    """`prompt_logprobs_last_n` (the Tinker face's: score only the last N prompt tokens):
    None, or an N in [1, len(prompt) - 1] for every prompt, with prompt logprobs asked for."""
    if last_n is None:
        return
    if not prompt_logprobs:
        raise InputError(field, "applies to prompt logprobs; set prompt_logprobs to true")
    shortest = min(prompt_lengths, default=0)
    if not 1 <= last_n <= shortest - 1:
        raise InputError(
            field,
            f"must be between 1 and len(prompt) - 1 = {shortest - 1}, got {last_n}"
            if shortest >= 2
            else f"a prompt of {shortest} token(s) has no token to score (got {last_n})",
        )


def _check_sequences(prompts: int, num_samples: int, limits: Limits) -> None:
    if prompts * num_samples > limits.max_batch_size:
        field = "num_samples" if num_samples > 1 else "model_inputs"
        raise InputError(
            field,
            f"{prompts} prompt(s) x {num_samples} sample(s) = {prompts * num_samples} sequences "
            f"exceed max_batch_size {limits.max_batch_size}{limits.of_model}",
        )


def _check_budget(lengths: list[int], num_samples: int, max_tokens: int, limits: Limits) -> None:
    """`max_tokens` against the context length, and every sequence's tokens against the call's
    budget."""
    field = "sampling_params.max_tokens"
    if max_tokens >= limits.max_seq_length:
        raise InputError(
            field,
            f"{max_tokens} must be below the context length {limits.max_seq_length}"
            f"{limits.of_model}",
        )
    budget = limits.max_tokens_per_call
    total = num_samples * sum(length + max_tokens for length in lengths)
    if budget is not None and total > budget:
        raise InputError(
            field,
            f"{len(lengths)} prompt(s) x {num_samples} sample(s) reach {total} tokens, over "
            f"max_tokens_per_call {budget}{limits.of_model}",
        )


def check_prompts(
    model_inputs: Sequence[Tokens],
    num_samples: int,
    max_tokens: int,
    topk: int,
    limits: Limits,
) -> list[list[int]]:
    """A sample call's prompts and counts: sequences within the batch limit, `max_tokens` and
    every prompt within the context length and the call's budget, ids in range. Returns the
    prompts' token ids."""
    if not model_inputs:
        raise InputError("model_inputs", "at least one prompt is required")
    check_num_samples(num_samples)
    _check_sequences(len(model_inputs), num_samples, limits)
    check_topk(topk)
    tokens = [token_values(model_input) for model_input in model_inputs]
    _check_budget([len(t) for t in tokens], num_samples, max_tokens, limits)
    prompts = []
    for i, values in enumerate(tokens):
        field = f"model_inputs[{i}]"
        check_has_tokens(len(values), field)
        ids = check_ids(values, token_field(model_inputs[i], field), limits.vocab_size)
        if len(ids) + max_tokens > limits.max_seq_length:
            raise InputError(
                field,
                f"{len(ids)} prompt tokens + max_tokens {max_tokens} exceed the context length "
                f"{limits.max_seq_length}",
            )
        prompts.append([int(t) for t in ids.tolist()])
    return prompts
