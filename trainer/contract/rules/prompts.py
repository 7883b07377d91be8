"""The rules of a sample call: its prompts and counts (sequences within the batch limit,
`max_tokens` and every prompt within the context length and the call's token budget, ids in
range), `topk_prompt_logprobs`, the Tinker face's `prompt_logprobs_last_n`, and the ids to
score at prompt positions (`target_prompt_ids`) and draws per position (`prompt_alt_tokens_k`)."""

from __future__ import annotations

from collections.abc import Sequence

from trainer.contract.errors import InputError
from trainer.contract.rules.limits import Limits, Tokens
from trainer.contract.rules.numbers import check_has_tokens, check_ids, token_field, token_values

MAX_TOPK_PROMPT_LOGPROBS = 20
MAX_TARGET_PROMPT_COLUMNS = 64
"""Ids one prompt position may name in `target_prompt_ids` (a row's width)."""


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


def check_alt_k(k: int, field: str = "prompt_alt_tokens_k") -> None:
    """Draws per prompt position: bounded like a top-k width."""
    if not 0 <= k <= MAX_TOPK_PROMPT_LOGPROBS:
        raise InputError(field, f"must be in [0, {MAX_TOPK_PROMPT_LOGPROBS}]")


def check_target_ids(
    tables: Sequence[Sequence[Sequence[int]]] | None,
    prompt_lengths: Sequence[int],
    vocab_size: int | None,
    field: str = "target_prompt_ids",
) -> None:
    """`target_prompt_ids`: None, or one table per prompt (`check_target_table`, `{field}[p]`)."""
    if tables is None:
        return
    if len(tables) != len(prompt_lengths):
        raise InputError(field, f"has {len(tables)} tables for {len(prompt_lengths)} prompts")
    for p, (table, length) in enumerate(zip(tables, prompt_lengths, strict=True)):
        check_target_table(table, length, vocab_size, f"{field}[{p}]")


def check_target_table(
    table: Sequence[Sequence[int]], length: int, vocab_size: int | None, field: str
) -> None:
    """One prompt's ids to score: [len(prompt) - 1, K] (row i: position i + 1), 1 <= K <=
    `MAX_TARGET_PROMPT_COLUMNS`, each id -1 (nothing asked) or in range, at least one asked."""
    if len(table) != length - 1:
        raise InputError(
            field, f"has {len(table)} rows; the prompt needs len(prompt) - 1 = {length - 1}"
        )
    widths = {len(row) for row in table}
    if len(widths) != 1 or not 1 <= min(widths) <= MAX_TARGET_PROMPT_COLUMNS:
        raise InputError(field, f"rows must all hold the same 1..{MAX_TARGET_PROMPT_COLUMNS} ids")
    if all(t == -1 for row in table for t in row):
        raise InputError(field, "names no token id (every cell is -1)")
    for i, row in enumerate(table):  # -1 read as 0 keeps a bad id's column in its name
        check_ids([0 if t == -1 else t for t in row], f"{field}[{i}]", vocab_size)
