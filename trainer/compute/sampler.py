"""Generation on the published weights: one decode loop, left-padded rows, one KV cache.

Design notes: `docs/design/compute.md`.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
from torch import nn

from trainer.compute import moe_replay
from trainer.compute.attention import padded_masks
from trainer.compute.draws import DecodeJob as DecodeJob  # the job and row types, re-exported
from trainer.compute.draws import Draws, next_tokens
from trainer.compute.draws import SampleWatch as SampleWatch
from trainer.compute.draws import Sequence as Sequence
from trainer.compute.draws import StopCheck as StopCheck
from trainer.compute.draws import non_finite_logits as non_finite_logits
from trainer.compute.draws import watch_failed as watch_failed
from trainer.compute.multilora import Segment, segmented
from trainer.compute.prompt_scores import prompt_logprobs
from trainer.contract.errors import OperationError
from trainer.contract.specs import STOP_CANCELLED as STOP_CANCELLED  # the stop reasons, here
from trainer.contract.specs import STOP_LENGTH as STOP_LENGTH  # for the decode loop's users
from trainer.contract.specs import STOP_STOP as STOP_STOP

Forward = Callable[..., Any]
"""A call of the model with keyword inputs (`input_ids`, `attention_mask`, ...)."""

__all__ = ["prompt_logprobs"]  # re-exported: the prompt side lives in `prompt_scores`


class Report(Protocol):
    """Told once per job of a generation (its index in `jobs`): its sequences grouped by prompt
    as soon as all its rows are done, or the error that ended it (`error`, its groups partial)."""

    def __call__(
        self, job: int, groups: list[list[Sequence]], error: OperationError | None
    ) -> None: ...


@dataclass(frozen=True)
class Turns:
    """`give()` after every `every` decode steps (0 or no `give`: never): it may let other
    operations run and must hand the model back as it was (`trainer/engine/in_process.py`). The
    KV cache, the last logits and the token generators are the generation's own, so the tokens
    and logprobs are the same whether or not it is called."""

    every: int = 0
    give: Callable[[], None] | None = None

    def due(self, step: int) -> bool:
        """Whether the turn is given before decode step `step` (never before the first)."""
        return self.every > 0 and step > 0 and step % self.every == 0


def draw_seed(seed: int | None, rng: torch.Generator | None = None) -> int:
    """`seed`, or a seed drawn from `rng` (None: the global RNG, a session's own stream while
    its operation runs)."""
    if seed is not None:
        return int(seed)
    return int(torch.randint(0, 2**62, (), generator=rng).item())


def cache_kwarg(model: nn.Module) -> str:
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


def given_mask(mask: torch.Tensor, rows: list[list[int]]) -> torch.Tensor | None:
    """The prompts' attention mask as the model is given it: None when no row is padded (a
    mask of ones is no mask to the model, and none leaves it nothing to check on the device)."""
    return mask if len({len(row) for row in rows}) > 1 else None


def decode_step(
    call: Forward,
    chosen: torch.Tensor,
    attention: torch.Tensor | None,
    next_pos: torch.Tensor,
    cache_kw: dict[str, Any],
) -> tuple[Any, torch.Tensor | None, torch.Tensor]:
    """One decode step: every row's chosen token fed at its next position, the KV cache holding
    the rest. Returns the model's output, the grown attention mask (None: no row is padded)
    and the next positions."""
    if attention is not None:
        attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=-1)
    out = call(
        input_ids=chosen[:, None],
        attention_mask=attention,
        position_ids=next_pos,
        use_cache=True,
        **cache_kw,
    )
    return out, attention, next_pos + 1


class _Calls:
    """The generation's model calls. With per-job adapters, every LoRA layer applies each job's
    adapter to its rows' positions (the head, which sees one position per row, a segment per
    row; a job's adapter that the head lacks: the head's base weights). Those forwards are
    installed for a call's positions per row and stay on the model between calls, until `off`."""

    def __init__(
        self, model: nn.Module, call: Forward, draws: list[Draws], padded: bool = False
    ) -> None:
        self.model, self.call, self.padded = model, call, padded
        self.spans = [(d.job.adapter, d.start, d.end) for d in draws]  # one per job
        self.head: nn.Module | None = None  # set when the jobs bring adapters
        self.head_adapters: set[str] = set()
        if any(adapter is not None for adapter, _, _ in self.spans):
            self.head = cast(Callable[[], nn.Module], model.get_output_embeddings)()
            self.head_adapters = set(getattr(self.head, "lora_A", {}))
        self.installed = contextlib.ExitStack()
        self.length = 0  # positions per row of the installed forwards (0: none installed)

    def __call__(self, **inputs: Any) -> Any:
        length = inputs["input_ids"].shape[1]
        if self.head is not None and length != self.length:
            self._install(self.head, length)
        with padded_masks(self.padded):  # the mask's padding is known: no check on the device
            return self.call(**inputs)

    def _install(self, head: nn.Module, length: int) -> None:
        self.off()
        body = [Segment(a, s * length, e * length) for a, s, e in self.spans]
        last = [Segment(a if a in self.head_adapters else None, s, e) for a, s, e in self.spans]
        self.installed.enter_context(segmented(self.model, body))
        self.installed.enter_context(segmented(head, last))
        self.length = length

    def retire(self, job: int) -> None:
        """A finished job's rows run on the base weights from now on: its adapter (which its
        session may change or drop once told) is no longer read."""
        _, start, end = self.spans[job]
        if self.spans[job][0] is not None:
            self.spans[job] = (None, start, end)
            self.off()  # installed again for the next call

    def off(self) -> None:
        """The model's own forwards again (while other operations use it, and at the end)."""
        self.installed.close()
        self.length = 0


def generate(
    model: nn.Module,
    jobs: list[DecodeJob],
    *,
    forward: Forward | None = None,
    agree: Callable[[torch.Tensor], torch.Tensor] | None = None,
    turns: Turns | None = None,
    report: Report | None = None,
) -> list[list[list[Sequence]]]:
    """Each job's sequences grouped by prompt, from one generation of all the jobs' rows.

    `forward(**kwargs)` runs the model (default: `model` itself; a sharded model is called
    through its FSDP root). `agree(chosen)` returns the tokens to continue with: under
    torch.distributed, rank 0's choice broadcast to every rank, so all stay in lockstep.
    `turns`: when to let other operations run (`Turns`); the per-job adapters are off the
    model meanwhile, and the MoE recording paused. It runs in the caller's grad mode.

    A job whose running rows' logits are not finite fails alone (`non_finite_logits`): with
    `report`, it is told and the others go on; without, the error is raised at once. With
    `report`, each job is told as soon as its rows are done (one whose routes are recorded:
    once the generation ends and they are assigned), and its rows compute on the base weights
    from then on; the other rows' numbers do not depend on them."""
    turns = turns or Turns()
    rows = sum(job.rows for job in jobs)
    wanted = any(job.record_routed_experts for job in jobs)
    with moe_replay.recording(model, rows, wanted) as recorder:  # MoE routing replay
        give = moe_replay.pausing(recorder, turns.give)
        later = {
            i for i, job in enumerate(jobs) if recorder is not None and job.record_routed_experts
        }
        tell = _Teller(report, later)
        groups = _generate(model, jobs, forward or model, agree, Turns(turns.every, give), tell)
        if recorder is not None:
            wants = [job.record_routed_experts for job in jobs]
            moe_replay.assign(recorder, [job.prompts for job in jobs], groups, wants)
        tell.rest()
    return groups


class _Teller:
    """Tells `report` of each job once (the jobs in `later`: at `rest`); without `report`, a
    job's error is raised."""

    def __init__(self, report: Report | None, later: set[int]) -> None:
        self.report, self.later = report, later
        self.draws: list[Draws] = []

    def finished(self, calls: _Calls) -> None:
        """Report the jobs that finished since the last call, and retire their adapters."""
        for i, d in enumerate(self.draws):
            if not d.finished or d.reported:
                continue
            if d.error is not None and self.report is None:
                raise d.error
            calls.retire(i)
            if i not in self.later or d.error is not None:
                self._tell(i, d)

    def rest(self) -> None:
        for i, d in enumerate(self.draws):
            if not d.reported:
                self._tell(i, d)

    def _tell(self, i: int, d: Draws) -> None:
        d.reported = True
        if self.report is not None:
            self.report(i, d.grouped(), d.error)


def _generate(
    model: nn.Module,
    jobs: list[DecodeJob],
    call: Forward,
    agree: Callable[[torch.Tensor], torch.Tensor] | None,
    turns: Turns,
    tell: _Teller,
) -> list[list[list[Sequence]]]:
    draws = tell.draws
    for job in jobs:
        draws.append(Draws(job, draws[-1].end if draws else 0))
    rows = [prompt for job in jobs for prompt in job.prompts for _ in range(job.num_samples)]
    input_ids, mask, positions = left_padded(rows, next(model.parameters()).device)
    attention = given_mask(mask, rows)
    padded = attention is not None
    calls = _Calls(model, call, draws, padded)
    try:
        out = calls(  # the model makes its own cache: per layer type, or a class of its own
            input_ids=input_ids,
            attention_mask=attention,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
        )
        cache_kw = {cache_kwarg(model): out.past_key_values}
        next_pos = positions[:, -1:] + 1
        for step in range(max(job.params.max_tokens for job in jobs)):
            if turns.give is not None and turns.due(step):
                calls.off()  # the model's own forwards while other operations use it
                turns.give()
            chosen = next_tokens(out.logits[:, -1, :].float(), draws, agree, step)
            tell.finished(calls)
            if all(d.finished for d in draws):
                break
            out, attention, next_pos = decode_step(calls, chosen, attention, next_pos, cache_kw)
            if out.past_key_values is not None:  # a model may hand back a new cache object
                cache_kw = {cache_kwarg(model): out.past_key_values}
    finally:
        calls.off()
    return [d.grouped() for d in draws]
