"""Generation on the published weights: one decode loop, left-padded rows, one KV cache.

Design notes: `docs/design/compute.md`.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
from torch import nn

from trainer.compute import moe_replay
from trainer.compute.multilora import Segment, segmented
from trainer.compute.prompt_scores import prompt_logprobs
from trainer.contract.errors import OperationError
from trainer.contract.specs import STOP_CANCELLED as STOP_CANCELLED  # the stop reasons, here
from trainer.contract.specs import STOP_LENGTH as STOP_LENGTH  # for the decode loop's users
from trainer.contract.specs import STOP_STOP as STOP_STOP
from trainer.contract.specs import SamplingParams

StopCheck = Callable[[list[int]], bool]
"""Whether a row's tokens so far end in a stop (a stop string)."""

Forward = Callable[..., Any]
"""A call of the model with keyword inputs (`input_ids`, `attention_mask`, ...)."""

__all__ = ["prompt_logprobs"]  # re-exported: the prompt side lives in `prompt_scores`


@dataclass
class Sequence:
    """One generated row. `logprobs`: each token's logprob under the model (raw logits);
    `sampling_logprobs` (when asked): under the distribution it was drawn from;
    `top_logprobs` (when asked): per token, the model's k most likely ids and logprobs."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stop_reason: str = STOP_LENGTH
    sampling_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[str, list]] = field(default_factory=list)
    routed_experts: torch.Tensor | None = (
        None  # MoE expert ids when recorded (`trainer/compute/moe_replay.py`)
    )


@dataclass
class DecodeJob:
    """One call's rows of a generation, prompt by prompt, `num_samples` rows each. A row stops
    at a token of `eos_ids`, when `stop_hit` says so, or after `params.max_tokens` tokens.
    `record_routed_experts`: each sequence gets the MoE experts its positions were routed to.
    `sampling_logprobs`: each token also gets its logprob under the distribution it was drawn
    from (`params.top_logprobs` > 0: the model's top k per token). `watch`: `SampleWatch`."""

    prompts: list[list[int]]
    num_samples: int
    params: SamplingParams
    eos_ids: set[int]
    seed: int
    stop_hit: StopCheck | None = None
    adapter: str | None = None
    record_routed_experts: bool = False
    sampling_logprobs: bool = False
    watch: SampleWatch | None = None

    @property
    def rows(self) -> int:
        return len(self.prompts) * self.num_samples


class SampleWatch(Protocol):
    """A caller's view of its job while it generates, called from the generating thread.

    `stopped()` is asked once per decode step: when true the job ends at once, its rows keep
    the tokens they have, with stop reason `STOP_CANCELLED`. `step(sequences)` is told after
    each decode step the job's sequences (live objects: copy what you keep); it must be cheap.
    A watch that raises fails its own job alone; the other jobs of the batch go on."""

    def stopped(self) -> bool: ...

    def step(self, sequences: list[Sequence]) -> None: ...


def watch_failed(exc: Exception) -> OperationError:
    """A job's `SampleWatch` raised: the job fails, alone."""
    return OperationError(
        "INTERNAL_ERROR", f"the sample's watch failed: {type(exc).__name__}: {exc}"
    )


class Report(Protocol):
    """Told once per job of a generation (its index in `jobs`): its sequences grouped by prompt
    as soon as all its rows are done, or the error that ended it (`error`, its groups partial)."""

    def __call__(
        self, job: int, groups: list[list[Sequence]], error: OperationError | None
    ) -> None: ...


def non_finite_logits() -> OperationError:
    """A job's logits stopped being finite: its weights are (LoRA: its adapter is) broken."""
    return OperationError(
        "NON_FINITE_LOSS",
        "the sampling logits are not finite: the weights this sample is served from produce "
        "NaN or infinity (weights-sync weights that generate finite logits)",
    )


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


def _choose(
    logits_S_V: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's token, and the log-distribution it was drawn from (after temperature, top-k
    and top-p; None when greedy)."""
    if params.temperature == 0.0:
        return logits_S_V.argmax(-1), None
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
    chosen = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1)
    return chosen.to(logits.device), torch.log_softmax(logits, dim=-1)


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
    call: Forward,
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


class _Draws:
    """One job's rows `[start, end)` of the batch while it generates: its token generator, its
    sequences and which of them have stopped."""

    def __init__(self, job: DecodeJob, start: int) -> None:
        self.job = job
        self.start, self.end = start, start + job.rows
        self.generator = torch.Generator().manual_seed(job.seed)
        self.sequences = [Sequence() for _ in range(job.rows)]
        self.done = [False] * job.rows
        self.finished = False
        self.error: OperationError | None = None
        self.reported = False
        self.drawn_from: torch.Tensor | None = None  # this step's drawn-from log-distribution

    def finite(self, logits: torch.Tensor) -> bool:
        """Whether the logits of its running rows are finite (else it fails, alone)."""
        running = torch.tensor([not d for d in self.done], device=logits.device)
        if bool(torch.isfinite(logits[self.start : self.end][running]).all()):
            return True
        self.error, self.finished = non_finite_logits(), True
        return False

    def cancelled(self) -> bool:
        """Whether its watch says stop (then its running rows end, `STOP_CANCELLED`)."""
        watch = self.job.watch
        if watch is None or not self._watched(watch.stopped):
            return False
        if self.error is None:
            for r, seq in enumerate(self.sequences):
                if not self.done[r]:
                    seq.stop_reason, self.done[r] = STOP_CANCELLED, True
        self.finished = True
        return True

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        chosen, self.drawn_from = _choose(
            logits[self.start : self.end], self.job.params, self.generator
        )
        return chosen

    def take(self, logits: torch.Tensor, chosen: torch.Tensor, step: int) -> None:
        """Each running row's token and its logprobs (the model's; when asked, the drawn-from
        distribution's and the model's top k), copied to the host at once; the job is finished
        once every row has stopped or the step was its last."""
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
        if k > 0:  # ids travel as floats (exact below 2**24) so one copy brings everything
            top_values, top_indices = torch.topk(logprobs, k, dim=-1)
            columns.extend([*top_indices.T.to(logprobs.dtype), *top_values.T])
        host = torch.stack(columns, dim=-1).cpu().tolist()  # [rows, 1 (+1) (+2k)]
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

    def _watched(self, call: Callable[[], Any]) -> Any:
        """A call of the job's watch; one that raises fails this job alone."""
        try:
            return call()
        except Exception as exc:
            self.error, self.finished = watch_failed(exc), True
            return True

    def grouped(self) -> list[list[Sequence]]:
        n = self.job.num_samples
        return [self.sequences[i * n : (i + 1) * n] for i in range(len(self.job.prompts))]


class _Calls:
    """The generation's model calls. With per-job adapters, every LoRA layer applies each job's
    adapter to its rows' positions (the head, which sees one position per row, a segment per
    row; a job's adapter that the head lacks: the head's base weights). Those forwards are
    installed for a call's positions per row and stay on the model between calls, until `off`."""

    def __init__(self, model: nn.Module, call: Forward, draws: list[_Draws]) -> None:
        self.model, self.call = model, call
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
        self.draws: list[_Draws] = []

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

    def _tell(self, i: int, d: _Draws) -> None:
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
    from transformers import DynamicCache

    draws = tell.draws
    for job in jobs:
        draws.append(_Draws(job, draws[-1].end if draws else 0))
    rows = [prompt for job in jobs for prompt in job.prompts for _ in range(job.num_samples)]
    input_ids, attention, positions = left_padded(rows, next(model.parameters()).device)
    config = cast(Any, model).config  # sliding and linear-attention layers get their own cache
    cache_kw = {_cache_kwarg(model): DynamicCache(config=config)}
    calls = _Calls(model, call, draws)
    try:
        out = calls(
            input_ids=input_ids,
            attention_mask=attention,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **cache_kw,
        )
        next_pos = positions[:, -1:] + 1
        for step in range(max(job.params.max_tokens for job in jobs)):
            if turns.give is not None and turns.due(step):
                calls.off()  # the model's own forwards while other operations use it
                turns.give()
            chosen = _step(out.logits[:, -1, :].float(), draws, agree, step)
            tell.finished(calls)
            if all(d.finished for d in draws):
                break
            out, attention, next_pos = decode_step(calls, chosen, attention, next_pos, cache_kw)
    finally:
        calls.off()
    return [d.grouped() for d in draws]


def _step(
    logits: torch.Tensor,
    draws: list[_Draws],
    agree: Callable[[torch.Tensor], torch.Tensor] | None,
    step: int,
) -> torch.Tensor:
    """Every running job's tokens (agreed on), appended to its rows; the tokens every row is
    fed next (a finished or failed job's rows: 0)."""
    running = [d for d in draws if not d.finished and not d.cancelled() and d.finite(logits)]
    chosen = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
    for d in running:
        chosen[d.start : d.end] = d.choose(logits)
    if agree is not None:
        chosen = agree(chosen)
    for d in running:
        d.take(logits, chosen, step)
    return chosen
