"""The rules of a forward-backward's samples: their count and token total, each sample's tokens,
its `loss_fn_inputs` (what the loss needs, dtypes, one value per token or [T, K] soft targets,
target ids in range) and, for a custom loss, its gradients."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

from trainer.contract.arrays import IntArray, NumArray
from trainer.contract.errors import InputError
from trainer.contract.losses import LOSS_INPUTS, MAX_TARGET_COLUMNS, SOFT_INPUTS, InputRule
from trainer.contract.rules.limits import (
    GradientLike,
    Limits,
    Needs,
    SampleLike,
    Tensor,
    Tokens,
)
from trainer.contract.rules.numbers import check_has_tokens, check_ids, token_field, token_values


def check_count(count: int, limits: Limits, field: str = "samples") -> None:
    if count == 0:
        raise InputError(field, "at least one sample is required")
    if count > limits.max_batch_size:
        raise InputError(
            field,
            f"{count} samples exceed max_batch_size {limits.max_batch_size}{limits.of_model}",
        )


def check_token_budget(total: int, limits: Limits, field: str = "samples") -> None:
    """A call's token total against `max_tokens_per_call` (None: unchecked)."""
    budget = limits.max_tokens_per_call
    if budget is not None and total > budget:
        raise InputError(
            field,
            f"{total} tokens in all exceed max_tokens_per_call {budget}{limits.of_model}; "
            "split the call",
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
    check_token_budget(sum(len(t) for t in tokens), limits)
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
