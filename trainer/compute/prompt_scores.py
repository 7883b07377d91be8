"""The prompt side of a sample: teacher-forced logprobs of the prompt's own tokens, their
top-k alternatives, the logprobs of ids the caller names at given positions, and draws from
each position's next-token distribution. Split from `trainer.compute.sampler` (the decode
loop), which re-exports `prompt_logprobs`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

Forward = Callable[..., Any]
"""A call of the model with keyword inputs (`input_ids`, ...)."""


@torch.no_grad()
def prompt_logprobs(
    model: nn.Module,
    prompt: list[int],
    topk: int,
    forward: Forward | None = None,
    last_n: int | None = None,
) -> tuple[list[float | None], list[dict[str, list]]]:
    """Teacher-forced logprobs of each prompt token (entry 0 is a 0.0 placeholder), and the
    top-k alternatives per position (entry 0 empty).

    `last_n` (1 <= N <= len(prompt) - 1, checked by the caller) scores only the last N tokens:
    the head and its log-softmax run on the N + 1 last positions alone (`logits_to_keep`), and
    the entries before are None (their top-k rows empty)."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    call = model if forward is None else forward
    scored = len(prompt) - 1 if last_n is None else last_n
    kwargs: dict[str, Any] = {} if last_n is None else {"logits_to_keep": last_n + 1}
    # the positions whose logits predict the scored tokens (a model that ignores
    # `logits_to_keep` returns them all: the slice keeps the same ones)
    logits_N_V = call(input_ids=ids, **kwargs).logits[0, -(scored + 1) : -1]
    logprobs_N_V = torch.log_softmax(logits_N_V.float(), dim=-1)
    targets = ids[0, len(prompt) - scored :]
    chosen = logprobs_N_V.gather(-1, targets[:, None]).squeeze(-1).tolist()
    skipped = len(prompt) - 1 - scored
    top: list[dict[str, list]] = [{"token_ids": [], "logprobs": []}]
    if topk > 0:
        top.extend({"token_ids": [], "logprobs": []} for _ in range(skipped))
        values, indices = torch.topk(logprobs_N_V, topk, dim=-1)
        for v, i in zip(values.tolist(), indices.tolist(), strict=True):
            top.append({"token_ids": i, "logprobs": v})
    return [0.0, *([None] * skipped), *chosen], top


@dataclass(frozen=True)
class PromptExtras:
    """What a prompt asks beyond its own tokens' logprobs, each over positions 1..T-1 (row i
    is position i + 1; position 0 has no context).

    `target_ids`: [T - 1, K] token ids whose logprobs to return, -1 where none is asked (those
    cells answer None). `alt_k`: draws per position, with replacement, from the model's
    next-token distribution at `temperature` (0: the argmax, k times), each with its logprob
    under the model (raw logits). `generator` draws them."""

    target_ids: list[list[int]] | None = None
    alt_k: int = 0
    temperature: float = 1.0
    generator: torch.Generator | None = None


@dataclass
class ExtraScores:
    """`PromptExtras`' answers: `target_logprobs` [T - 1, K]; `alt_tokens` / `alt_logprobs`
    [T - 1, k] (None where not asked)."""

    target_logprobs: list[list[float | None]] | None = None
    alt_tokens: list[list[int]] | None = None
    alt_logprobs: list[list[float]] | None = None


@torch.no_grad()
def prompt_extras(
    model: nn.Module, prompt: list[int], extras: PromptExtras, forward: Forward | None = None
) -> ExtraScores:
    """`extras` answered from one forward of `prompt`. With target ids alone, the head and its
    log-softmax run only from the first row that names an id (`logits_to_keep`)."""
    rows = len(prompt) - 1
    first = 0
    if extras.target_ids is not None and extras.alt_k == 0:
        first = next((i for i, row in enumerate(extras.target_ids) if any(t >= 0 for t in row)), 0)
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    call = model if forward is None else forward
    kept = rows - first  # rows [first, rows) are scored
    if kept <= 0:  # a one-token prompt: no position to score or draw at
        empty = ExtraScores(target_logprobs=[] if extras.target_ids is not None else None)
        if extras.alt_k:
            empty.alt_tokens, empty.alt_logprobs = [], []
        return empty
    logits_N_V = call(input_ids=ids, logits_to_keep=kept + 1).logits[0, -(kept + 1) : -1].float()
    logprobs_N_V = torch.log_softmax(logits_N_V, dim=-1)
    out = ExtraScores()
    if extras.target_ids is not None:
        asked = extras.target_ids
        ids_N_K = torch.tensor(asked[first:], dtype=torch.long, device=device)
        got = logprobs_N_V.gather(-1, ids_N_K.clamp(min=0)).cpu().tolist()
        out.target_logprobs = [[None] * len(row) for row in asked[:first]] + [
            [lp if t >= 0 else None for t, lp in zip(row, values, strict=True)]
            for row, values in zip(asked[first:], got, strict=True)
        ]
    if extras.alt_k > 0:
        if extras.temperature == 0.0:
            drawn = logits_N_V.argmax(-1, keepdim=True).expand(-1, extras.alt_k)
        else:
            probs = torch.softmax(logits_N_V / extras.temperature, dim=-1).cpu()
            drawn = torch.multinomial(
                probs, extras.alt_k, replacement=True, generator=extras.generator
            )
            drawn = drawn.to(device)
        out.alt_tokens = drawn.cpu().tolist()
        out.alt_logprobs = logprobs_N_V.gather(-1, drawn).cpu().tolist()
    return out
