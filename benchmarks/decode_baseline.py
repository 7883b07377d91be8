"""The decode loop's token choice as it was before it stayed on the device, as a benchmark arm
(`scripts/bench_decode.py --baseline`).

Per step and per job it checked its running rows' logits for finiteness on the host (an
upload of the rows' mask, then `bool`), drew with `torch.multinomial` on a CPU generator (the
whole `[rows, vocab]` distribution copied to the host; two validity checks, each a sync),
and copied its tokens and logprobs to the host; a mask of ones went to the model, which
checked it on the device (`padding_mask.all()`) every forward. `old_loop()` runs
`trainer.compute.sampler.generate` that way: the same loop, model calls and bookkeeping, with
the old per-job draw and read patched in. The same seed draws the same tokens on a CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from trainer.compute import draws, sampler
from trainer.contract.specs import STOP_STOP, SamplingParams


def old_choose(
    logits_S_V: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The old `_choose`: `torch.multinomial` on the host."""
    if params.temperature == 0.0:
        return logits_S_V.argmax(-1), None
    logits = logits_S_V / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(-1) - probs > params.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    chosen = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1)
    return chosen.to(logits.device), torch.log_softmax(logits, dim=-1)


class OldDraws(draws.Draws):
    """`Draws` with the old per-job finiteness check, draw and read."""

    def __init__(self, job: draws.DecodeJob, start: int) -> None:
        super().__init__(job, start)
        self.cpu_generator = torch.Generator().manual_seed(job.seed)

    def finite(self, logits: torch.Tensor) -> bool:
        running = torch.tensor([not d for d in self.done], device=logits.device)
        if bool(torch.isfinite(logits[self.start : self.end][running]).all()):
            return True
        self.error, self.finished = draws.non_finite_logits(), True
        return False

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        chosen, self.drawn_from = old_choose(
            logits[self.start : self.end], self.job.params, self.cpu_generator
        )
        return chosen

    def take_old(self, logits: torch.Tensor, chosen: torch.Tensor, step: int) -> None:
        job = self.job
        picked = chosen[self.start : self.end]
        logprobs = torch.log_softmax(logits[self.start : self.end], dim=-1)
        columns = [logprobs.gather(-1, picked[:, None]).squeeze(-1)]
        if job.sampling_logprobs:
            drawn = self.drawn_from
            columns.append(
                torch.zeros_like(columns[0])
                if drawn is None
                else drawn.gather(-1, picked[:, None]).squeeze(-1)
            )
        k = job.params.top_logprobs
        if k > 0:
            top_values, top_indices = torch.topk(logprobs, k, dim=-1)
            columns.extend([*top_indices.T.to(logprobs.dtype), *top_values.T])
        host = torch.stack(columns, dim=-1).cpu().tolist()
        for r, (token, values) in enumerate(zip(picked.tolist(), host, strict=True)):
            if self.done[r]:
                continue
            seq = self.sequences[r]
            seq.tokens.append(token)
            seq.logprobs.append(values[0])
            if job.sampling_logprobs:
                seq.sampling_logprobs.append(values[1])
            if k > 0:
                ids = [int(t) for t in values[-2 * k : -k]]
                seq.top_logprobs.append({"token_ids": ids, "logprobs": values[-k:]})
            if token in job.eos_ids or (job.stop_hit is not None and job.stop_hit(seq.tokens)):
                seq.stop_reason = STOP_STOP
                self.done[r] = True
        self.finished = all(self.done) or step + 1 >= job.params.max_tokens
        watch = job.watch
        if watch is not None:
            self._watched(lambda: watch.step(self.sequences))


def old_tokens(
    logits: torch.Tensor,
    all_draws: list[OldDraws],
    agree: Callable[[torch.Tensor], torch.Tensor] | None,
    step: int,
) -> torch.Tensor:
    """The old `_step`."""
    running = [d for d in all_draws if not d.finished and not d.cancelled() and d.finite(logits)]
    chosen = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
    for d in running:
        chosen[d.start : d.end] = d.choose(logits)
    if agree is not None:
        chosen = agree(chosen)
    for d in running:
        d.take_old(logits, chosen, step)
    return chosen


def _unchecked(padded: bool = True) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


@contextlib.contextmanager
def old_loop() -> Iterator[None]:
    """`sampler.generate` with the old draw and read (the module docstring), until exit."""
    patches: dict[str, Any] = {
        "Draws": OldDraws,
        "next_tokens": old_tokens,
        "padded_masks": _unchecked,
        "given_mask": lambda mask, rows: mask,
    }
    saved = {name: getattr(sampler, name) for name in patches}
    for name, value in patches.items():
        setattr(sampler, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(sampler, name, value)
