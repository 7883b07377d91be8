"""Generation on the published weights: batched, left-padded, with a KV cache.

Sampled-token logprobs are the model's own (temperature 1, before top-k/top-p), so at the same
weights they equal what forward-backward computes for the same tokens: the importance ratio of
an on-policy sample is 1. `temperature`, `top_k` and `top_p` shape only the choice of token.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from trainer.contract.specs import SamplingParams

STOP_LENGTH = "STOP_REASON_LENGTH"
STOP_STOP = "STOP_REASON_STOP"


@dataclass
class Sequence:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stop_reason: str = STOP_LENGTH
    routes: torch.Tensor | None = (
        None  # MoE expert ids when recorded (`trainer/compute/moe_replay.py`)
    )


def _choose(
    logits_S_V: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> torch.Tensor:
    if params.temperature == 0.0:
        return logits_S_V.argmax(-1)
    logits = logits_S_V / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(-1) - probs > params.top_p  # keep the smallest set reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


def _cache_kwarg(model: nn.Module) -> str:
    """transformers renamed `past_key_values` to `cache` in 5.x; use whichever forward takes."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def left_padded(
    rows: list[list[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompts as one left-padded batch on `device`: token ids, attention mask, positions."""
    width = max(len(p) for p in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention = torch.zeros(len(rows), width, dtype=torch.long)
    for r, prompt in enumerate(rows):
        input_ids[r, width - len(prompt) :] = torch.tensor(prompt)
        attention[r, width - len(prompt) :] = 1
    input_ids, attention = input_ids.to(device), attention.to(device)
    return input_ids, attention, (attention.cumsum(-1) - 1).clamp(min=0)


def decode_step(
    call: Callable[..., Any],
    chosen: torch.Tensor,
    attention: torch.Tensor,
    next_pos: torch.Tensor,
    cache_kw: dict[str, Any],
) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """One decode step: every row's chosen token fed at its next position, the KV cache holding
    the rest. Returns the model's output, the grown attention mask and the next positions."""
    attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=-1)
    out = call(
        input_ids=chosen[:, None],
        attention_mask=attention,
        position_ids=next_pos,
        use_cache=True,
        **cache_kw,
    )
    return out, attention, next_pos + 1


def generate(
    model: nn.Module,
    prompts: list[list[int]],
    *,
    num_samples: int,
    params: SamplingParams,
    eos_ids: set[int],
    stop_hit: Callable[[list[int]], bool] | None = None,
    seed: int | None = None,
    forward: Callable[..., Any] | None = None,
    agree: Callable[[torch.Tensor], torch.Tensor] | None = None,
    give_turn: Callable[[], None] | None = None,
    turn_steps: int = 0,
) -> list[list[Sequence]]:
    """`num_samples` completions for each prompt; returns sequences grouped by prompt.

    `forward(**kwargs)` runs the model (default: `model` itself; a sharded model is called
    through its FSDP root). `agree(chosen_S)` returns the tokens to continue with: under
    torch.distributed, rank 0's choice broadcast to every rank, so all stay in lockstep.
    `give_turn()` is called after every `turn_steps` decode steps (0: never): it may let
    other operations run and must hand the model back as it was (`engine/generator.py`).
    The KV cache, the last logits and the token generator are this call's own, so the tokens
    and logprobs are the same whether or not it is called.
    """
    from transformers import DynamicCache

    call = model if forward is None else forward

    device = next(model.parameters()).device
    rows = [prompt for prompt in prompts for _ in range(num_samples)]
    input_ids, attention, positions = left_padded(rows, device)
    generator = torch.Generator()
    generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
    cache_kw = {_cache_kwarg(model): DynamicCache()}
    out = call(
        input_ids=input_ids,
        attention_mask=attention,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,
        **cache_kw,
    )
    sequences = [Sequence() for _ in rows]
    done = torch.zeros(len(rows), dtype=torch.bool)
    next_pos = positions[:, -1:] + 1
    for step in range(params.max_tokens):
        if give_turn is not None and turn_steps > 0 and step > 0 and step % turn_steps == 0:
            give_turn()
        logits = out.logits[:, -1, :].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        chosen = _choose(logits, params, generator)
        if agree is not None:
            chosen = agree(chosen)
        chosen_lp = logprobs.gather(-1, chosen[:, None]).squeeze(-1).cpu()
        for r, seq in enumerate(sequences):
            if done[r]:
                continue
            token = int(chosen[r])
            seq.tokens.append(token)
            seq.logprobs.append(float(chosen_lp[r]))
            if token in eos_ids or (stop_hit is not None and stop_hit(seq.tokens)):
                seq.stop_reason = STOP_STOP
                done[r] = True
        if bool(done.all()) or len(sequences[0].tokens) >= params.max_tokens:
            break
        out, attention, next_pos = decode_step(call, chosen, attention, next_pos, cache_kw)
    return [sequences[i * num_samples : (i + 1) * num_samples] for i in range(len(prompts))]


@torch.no_grad()
def prompt_logprobs(
    model: nn.Module, prompt: list[int], topk: int, forward: Callable[..., Any] | None = None
) -> tuple[list[float], list[dict[str, list]]]:
    """Teacher-forced logprobs of each prompt token (entry 0 is a 0.0 placeholder), and the
    top-k alternatives per position (entry 0 empty)."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    call = model if forward is None else forward
    logprobs_L_V = torch.log_softmax(call(input_ids=ids).logits[0].float(), dim=-1)
    targets = ids[0, 1:]
    chosen = logprobs_L_V[:-1].gather(-1, targets[:, None]).squeeze(-1).tolist()
    top: list[dict[str, list]] = [{"token_ids": [], "logprobs": []}]
    if topk > 0:
        values, indices = torch.topk(logprobs_L_V[:-1], topk, dim=-1)
        for v, i in zip(values.tolist(), indices.tolist(), strict=True):
            top.append({"token_ids": i, "logprobs": v})
    return [0.0, *chosen], top
