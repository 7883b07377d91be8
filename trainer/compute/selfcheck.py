"""The check a model passes once at load: the trainer's logprobs equal the model's own forward.

`prove` runs a few short random sequences, longer than the model's smallest window, through
each exact layout of `trainer.compute.architecture` (fastest first) and compares their
logprobs with the model's own forward of each sequence alone, through its own attention
(`reference_attention`). The first layout that agrees within float noise is kept; when none
does, the model is refused with the measured differences (`ModelRefused`). Before that,
`check_head` proves the logit transform: what the model does between its last hidden state and
its logits must be what the trainer's head does. docs/semantics.md §17.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from trainer.compute.architecture import (
    PACKED,
    Architecture,
    describe,
    keep,
    output_head,
    text_config,
)
from trainer.compute.attention import PACKED_SDPA

log = logging.getLogger(__name__)

SEED = 20261203
EXTRA = (5, 3, 8)  # tokens past the smallest window, per probe sequence
PLAIN_LENGTH = 8  # the smallest window of a model without one


class ModelRefused(ValueError):
    """The worker cannot compute this model exactly; the message names the model type and
    the feature, with the measured difference."""


def tolerance(dtype: torch.dtype) -> float:
    """Largest max-abs logprob difference taken as float noise: 1e-3 in float32; in 16-bit
    formats, where two kernels round differently, 0.05 on the mean absolute difference."""
    return 1e-3 if dtype == torch.float32 else 5e-2


def _measure(diff: torch.Tensor, dtype: torch.dtype) -> float:
    if diff.numel() == 0:
        return 0.0
    return float(diff.max() if dtype == torch.float32 else diff.mean())


def probe_lengths(arch: Architecture, limit: int | None) -> list[int]:
    """Probe sequence lengths: a few tokens past the smallest window (or 8), within `limit`."""
    base = min(arch.windows) if arch.windows else PLAIN_LENGTH
    lengths = [base + extra for extra in EXTRA]
    return [max(2, min(n, limit)) if limit else n for n in lengths]


def probe_sequences(model: Any, arch: Architecture) -> list[torch.Tensor]:
    config = text_config(model)
    head = model.get_output_embeddings()
    vocab = int(getattr(config, "vocab_size", None) or head.weight.shape[0])
    limit = getattr(config, "max_position_embeddings", None)
    generator = torch.Generator().manual_seed(SEED)
    return [
        torch.randint(0, vocab, (n,), generator=generator)
        for n in probe_lengths(arch, int(limit) if limit else None)
    ]


def reference_attention(model: Any, current: str) -> str:
    """The attention the reference forward uses: the model's own implementation, never our
    varlen `packed_sdpa` (it is what is being checked)."""
    return "sdpa" if current == PACKED_SDPA else current


@torch.no_grad()
def reference_logprobs(model: Any, sequences: list[torch.Tensor], attn: str) -> torch.Tensor:
    """Each sequence alone through the model's own forward: the logprob of every next token,
    concatenated."""
    device = next(model.parameters()).device
    current = model.config._attn_implementation
    if attn != current:
        model.set_attn_implementation(attn)
    try:
        out = []
        for seq in sequences:
            logits = model(input_ids=seq[None].to(device), use_cache=False).logits[0, :-1]
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            out.append(logprobs.gather(-1, seq[1:, None].to(device)).squeeze(-1))
    finally:
        if attn != current:
            model.set_attn_implementation(current)
    return torch.cat(out).cpu()


@torch.no_grad()
def trainer_logprobs(model: Any, sequences: list[torch.Tensor], layout: str) -> torch.Tensor:
    """The same logprobs through the trainer's path: all sequences in one call, laid out as
    `layout`, decoder then the chunked head (`batch_logprobs`)."""
    from trainer.compute.batch import PreparedSample, pack
    from trainer.compute.logprobs import batch_logprobs

    samples = []
    for i, seq in enumerate(sequences):
        mask = torch.ones(seq.shape[0])
        mask[-1] = 0.0  # the last position predicts nothing here
        targets = torch.cat([seq[1:], seq[:1]])
        samples.append(PreparedSample(index=i, tokens_T=seq, targets_T=targets, mask_T=mask))
    total = sum(int(s.shape[0]) for s in sequences)
    batches = pack(
        samples, row_tokens=total, token_budget=total * len(sequences), one_per_row=layout != PACKED
    )
    device = next(model.parameters()).device
    out = []
    for batch in batches:
        logprobs, _, _ = batch_logprobs(model, batch, device, 1024, False)
        out.append(logprobs)
    return torch.cat(out).cpu()


@torch.no_grad()
def check_head(model: Any, arch: Architecture) -> float:
    """The trainer's head (`output_head`) against the model's own logits for the same last
    hidden state: the decoder's output is replaced by a probe state (large enough that a
    soft-cap bends it) and the model's logits compared with the head's. Refuses the model
    when they differ (a transform we do not reproduce); returns the difference."""
    decoder = model.get_decoder()
    device = next(model.parameters()).device
    config = text_config(model)
    hidden_size = int(config.hidden_size)
    generator = torch.Generator().manual_seed(SEED)
    probe = torch.randn(1, 4, hidden_size, generator=generator) * 8.0
    probe = probe.to(device, next(model.parameters()).dtype)

    def swap(_module: Any, _args: Any, output: Any) -> Any:
        output.last_hidden_state = probe
        return output

    handle = decoder.register_forward_hook(swap)
    try:
        ids = torch.zeros(1, 4, dtype=torch.long, device=device)
        theirs = model(input_ids=ids, use_cache=False).logits.float()
    finally:
        handle.remove()
    ours = output_head(model)(probe).float()
    diff = float((theirs - ours).abs().max()) if theirs.shape == ours.shape else float("inf")
    scale = max(1.0, float(theirs.abs().max()))
    if not diff <= tolerance(probe.dtype) * scale:
        raise ModelRefused(
            f"model type {arch.model_type!r} is refused: its logits are not its output head "
            f"followed by a transform the trainer reproduces ({arch.head.describe()}); "
            f"they differ by {diff:.3g}"
        )
    return diff


@torch.no_grad()
def check_left_padding(model: Any, arch: Architecture, sequences: list[torch.Tensor]) -> float:
    """The decode loop's batches (`trainer.compute.sampler`): the sequences but their last
    token prefilled left-padded in one batch, then one decode step of each last token through
    the model's own cache, give the logprobs of the model's own forward of each sequence alone
    at those two positions (over the whole vocabulary). Refuses the model when they differ (a
    layer that lets left padding into its state); returns the difference."""
    from trainer.compute.sampler import cache_kwarg, decode_step, given_mask, left_padded

    if len({len(seq) for seq in sequences}) == 1 and len(sequences[0]) > 2:
        # lengths clamped to a short context are all one: one shorter prompt makes the padding
        sequences = [sequences[0][: len(sequences[0]) // 2 + 1], *sequences[1:]]
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    rows = [[int(t) for t in seq[:-1]] for seq in sequences]
    ids, mask, positions = left_padded(rows, device)
    attention = given_mask(mask, rows)
    out = model(input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=True)
    first = torch.log_softmax(out.logits[:, -1].float(), dim=-1)
    last = torch.stack([seq[-1] for seq in sequences]).to(device)
    cache = {cache_kwarg(model): out.past_key_values}
    step, _, _ = decode_step(model, last, attention, positions[:, -1:] + 1, cache)
    second = torch.log_softmax(step.logits[:, -1].float(), dim=-1)
    diff = 0.0
    for r, seq in enumerate(sequences):
        alone = model(input_ids=seq[None].to(device), use_cache=False).logits[0, -2:]
        want = torch.log_softmax(alone.float(), dim=-1)
        got = torch.stack([first[r], second[r]])
        diff = max(diff, _measure((got - want).abs(), dtype))
    if not diff <= tolerance(dtype):
        features = "; ".join(arch.features()) or "plain attention"
        raise ModelRefused(
            f"model type {arch.model_type!r} ({features}) is refused: sampling left-pads the "
            f"prompts of a batch, and its layers let the padding into what they compute "
            f"(the logprobs of a prompt left-padded and alone differ by {diff:.3g})"
        )
    return diff


def prove(model: Any) -> Architecture:
    """Read the model's architecture, check its head and its layouts (module docstring), and
    keep the chosen one on the model. Raises `ModelRefused` when no layout is exact."""
    started = time.perf_counter()
    arch = describe(model)
    keep(model, arch)
    check_head(model, arch)
    dtype = next(model.parameters()).dtype
    sequences = probe_sequences(model, arch)
    was_training = model.training
    model.eval()
    try:
        reference = reference_logprobs(
            model, sequences, reference_attention(model, arch.attn_implementation)
        )
        checked: dict[str, float] = {}
        for layout in arch.candidates:
            keep(model, arch.chosen(layout, checked, 0.0))
            ours = trainer_logprobs(model, sequences, layout)
            diff = (ours - reference).abs() if ours.shape == reference.shape else None
            checked[layout] = float("inf") if diff is None else _measure(diff, dtype)
            if checked[layout] <= tolerance(dtype):
                check_left_padding(model, arch, sequences)
                chosen = arch.chosen(layout, checked, time.perf_counter() - started)
                keep(model, chosen)
                log.info(
                    "%s: %s, %s (checked in %.2fs: %s)",
                    arch.model_type,
                    "; ".join(chosen.features()) or "plain attention",
                    chosen.path(),
                    chosen.check_seconds,
                    checked,
                )
                return chosen
    finally:
        model.train(was_training)
    measured = ", ".join(f"{k}: {v:.3g}" for k, v in checked.items())
    features = "; ".join(arch.features()) or "plain attention"
    raise ModelRefused(
        f"model type {arch.model_type!r} ({features}) is refused: the trainer's logprobs differ "
        f"from the model's own forward of each sequence alone ({measured}; tolerance "
        f"{tolerance(dtype):g})"
    )
