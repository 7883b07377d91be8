"""Per-token logprobs of the target tokens, from hidden states, chunked over tokens.

The output head is applied to at most `chunk_tokens` rows at a time and recomputed in the
backward (activation checkpointing per chunk), so the full fp32 `[N, V]` logits never exist:
peak extra memory is one chunk's `[C, V]` logits. The log-sum-exp and the gather run in fp32
whatever the head's dtype. Any head module works (a plain `nn.Linear`, or a peft LoRA wrapper
around it, dropout included: checkpointing replays the RNG state).

This is the one place that turns hidden states into logprobs; the engine and the sampler both
call it, so speeding it up later changes one function.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

DEFAULT_CHUNK_TOKENS = 1024


def _chunk_logprobs(
    head: nn.Module, hidden_C_H: torch.Tensor, targets_C: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    logits_C_V = head(hidden_C_H).float()
    lse_C = torch.logsumexp(logits_C_V, dim=-1)
    target_logits_C = logits_C_V.gather(-1, targets_C[:, None]).squeeze(-1)
    return target_logits_C - lse_C, lse_C


def _chunk_entropy(logits_C_V: torch.Tensor, lse_C: torch.Tensor) -> torch.Tensor:
    probs = torch.exp(logits_C_V - lse_C[:, None])
    return lse_C - (probs * logits_C_V).sum(-1)


def token_logprobs(
    hidden_N_H: torch.Tensor,
    head: nn.Module,
    targets_N: torch.Tensor,
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return (`logprobs_N` fp32, `entropy_N` fp32 without gradient, or None).

    `logprobs_N[i] = log softmax(head(hidden_N_H[i]))[targets_N[i]]`.
    """
    if hidden_N_H.shape[0] != targets_N.shape[0]:
        raise ValueError("hidden states and targets must have the same number of tokens")
    needs_grad = torch.is_grad_enabled() and (
        hidden_N_H.requires_grad or any(p.requires_grad for p in head.parameters())
    )
    logprobs: list[torch.Tensor] = []
    entropies: list[torch.Tensor] = []
    for start in range(0, hidden_N_H.shape[0], chunk_tokens):
        hidden = hidden_N_H[start : start + chunk_tokens]
        targets = targets_N[start : start + chunk_tokens]
        if needs_grad:
            lp, lse = checkpoint(_chunk_logprobs, head, hidden, targets, use_reentrant=False)
        else:
            lp, lse = _chunk_logprobs(head, hidden, targets)
        logprobs.append(lp)
        if with_entropy:
            with torch.no_grad():
                entropies.append(_chunk_entropy(head(hidden.detach()).float(), lse.detach()))
    if not logprobs:
        empty = hidden_N_H.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    entropy = torch.cat(entropies) if with_entropy else None
    return torch.cat(logprobs), entropy


def naive_token_logprobs(
    hidden_N_H: torch.Tensor, head: nn.Module, targets_N: torch.Tensor
) -> torch.Tensor:
    """Reference: full fp32 `[N, V]` logits at once. For tests and benchmarks only."""
    logits_N_V = head(hidden_N_H).float()
    return torch.log_softmax(logits_N_V, dim=-1).gather(-1, targets_N[:, None]).squeeze(-1)
