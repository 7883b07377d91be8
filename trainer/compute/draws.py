"""The decode loop's token choices: each job's draws on the logits' device, read on the host
once per step.

A step (`next_tokens`) draws every running job's tokens where the logits are, from the job's own
generator, and packs what the host needs (per row: whether its logits are finite, the chosen
token, its logprob, and when asked the drawn-from logprob and the model's top k) for every
job into one float64 tensor, copied to the host once. float64 holds token ids and float32
values exactly. The bookkeeping (stops, watches, a job whose logits are not finite) then reads
that one copy. Design notes: `docs/design/compute.md`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from trainer.contract.errors import OperationError, invalid
from trainer.contract.specs import STOP_CANCELLED, STOP_LENGTH, STOP_STOP, SamplingParams

StopCheck = Callable[[list[int]], bool]
"""Whether a row's tokens so far end in a stop (a stop string)."""


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
    grammar: RowGrammar | None = None

    @property
    def rows(self) -> int:
        return len(self.prompts) * self.num_samples


class RowGrammar(Protocol):
    """What a job's rows may draw (`trainer/compute/grammar.py`): `bias(done, device)` before
    each draw (`[rows, vocab]` on the device, added to the logits: 0 or -inf), `take(r, token)`
    after it, end ids included (a message when the row's matcher refuses the token: no token
    was allowed). `field`: the request field an error names."""

    @property
    def field(self) -> str: ...

    def bias(self, done: list[bool], device: torch.device) -> torch.Tensor: ...

    def take(self, r: int, token: int) -> str | None: ...


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


def non_finite_logits() -> OperationError:
    """A job's logits stopped being finite: its weights are (LoRA: its adapter is) broken."""
    return OperationError(
        "NON_FINITE_LOSS",
        "the sampling logits are not finite: the weights this sample is served from produce "
        "NaN or infinity (weights-sync weights that generate finite logits)",
    )


def draw(probs_S_V: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row from `probs_S_V`, where the probabilities are: `torch.multinomial`'s
    own one-sample path (argmax of p / q, q ~ Exp(1)), the same tokens for the same generator
    state, without its validity checks (each a host sync). A row that is not a distribution
    (NaN) gets some index; the caller knows from its finite flag."""
    q = torch.empty_like(probs_S_V).exponential_(1, generator=generator)
    return torch.div(probs_S_V, q, out=q).argmax(dim=-1)


def _choose(
    logits_S_V: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's token, and the logits it was drawn from (after temperature, top-k and top-p;
    their log-softmax is the drawn-from log-distribution; None when greedy)."""
    if params.temperature == 0.0:
        return logits_S_V.argmax(-1), None
    logits = logits_S_V if params.temperature == 1.0 else logits_S_V / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(-1) - probs > params.top_p  # keep the smallest set reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return draw(torch.softmax(logits, dim=-1), generator), logits


class Draws:
    """One job's rows `[start, end)` of the batch while it generates: its token generator (on
    the logits' device, made at its first draw), its sequences and which of them have stopped."""

    def __init__(self, job: DecodeJob, start: int) -> None:
        self.job = job
        self.start, self.end = start, start + job.rows
        self.generator: torch.Generator | None = None
        self.sequences = [Sequence() for _ in range(job.rows)]
        self.done = [False] * job.rows
        self.finished = False
        self.error: OperationError | None = None
        self.reported = False
        self.drawn_from: torch.Tensor | None = None  # this step's drawn-from logits

    @property
    def width(self) -> int:
        """Its values per row in a step's copy: finite, token, logprob, (the drawn-from
        logprob), (k top ids, k top logprobs)."""
        return 3 + int(self.job.sampling_logprobs) + 2 * self.job.params.top_logprobs

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
        if self.generator is None:
            self.generator = torch.Generator(device=logits.device).manual_seed(self.job.seed)
        rows = logits[self.start : self.end]
        grammar = self.job.grammar
        if grammar is not None:  # the tokens outside the grammar masked out
            rows = rows + grammar.bias(self.done, rows.device)
        chosen, self.drawn_from = _choose(rows, self.job.params, self.generator)
        return chosen

    def columns(
        self, finite_S: torch.Tensor, logprobs_S_V: torch.Tensor, chosen_S: torch.Tensor
    ) -> torch.Tensor:
        """Its rows' part of the step's copy, `[rows, width]` float64 (`width`), on the device."""
        picked = chosen_S[self.start : self.end]
        logprobs = logprobs_S_V[self.start : self.end]
        columns = [finite_S[self.start : self.end], picked, logprobs.gather(-1, picked[:, None])]
        if self.job.sampling_logprobs:
            drawn = self.drawn_from
            columns.append(
                torch.zeros_like(columns[2])
                if drawn is None
                else torch.log_softmax(drawn, dim=-1).gather(-1, picked[:, None])
            )
        k = self.job.params.top_logprobs
        if k > 0:
            top_values, top_indices = torch.topk(logprobs, k, dim=-1)
            columns.extend([top_indices, top_values])
        return torch.cat([c.reshape(len(picked), -1).to(torch.float64) for c in columns], -1)

    def take(self, values: list[float], step: int) -> bool:
        """Each running row's token and its logprobs from its part of the step's copy (row by
        row, `width` values each); the job is finished once every row has stopped or the step
        was its last. False (and the job failed, alone) when a running row's logits were not
        finite: its rows then take nothing."""
        job, width, k = self.job, self.width, self.job.params.top_logprobs
        rows = [values[r * width : (r + 1) * width] for r in range(job.rows)]
        if not all(row[0] for row, done in zip(rows, self.done, strict=True) if not done):
            self.error, self.finished = non_finite_logits(), True
            return False
        for r, row in enumerate(rows):
            if self.done[r]:
                continue
            seq, token = self.sequences[r], int(row[1])
            seq.tokens.append(token)
            seq.logprobs.append(row[2])
            if job.sampling_logprobs:
                seq.sampling_logprobs.append(row[3])
            if k > 0:
                ids = [int(t) for t in row[-2 * k : -k]]
                seq.top_logprobs.append({"token_ids": ids, "logprobs": row[-k:]})
            if job.grammar is not None and not self._grammar_takes(job.grammar, r, token):
                return False
            if token in job.eos_ids or (job.stop_hit is not None and job.stop_hit(seq.tokens)):
                seq.stop_reason = STOP_STOP
                self.done[r] = True
        self.finished = all(self.done) or step + 1 >= job.params.max_tokens
        watch = job.watch
        if watch is not None:
            self._watched(lambda: watch.step(self.sequences))
        return True

    def _grammar_takes(self, grammar: RowGrammar, r: int, token: int) -> bool:
        """Row `r`'s matcher takes its token; when it refuses (no token was allowed: the
        vocabulary cannot continue the text) the job fails, alone, naming the field."""
        refused = grammar.take(r, token)
        if refused is None:
            return True
        why = f"no token of this model continues the grammar here ({refused})"
        self.error, self.finished = invalid(grammar.field, why), True
        return False

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


def to_host(
    logits_S_V: torch.Tensor, chosen_S: torch.Tensor, running: list[Draws]
) -> list[list[float]]:
    """Each running job's part of the step's copy (`Draws.columns`), packed into one tensor
    and brought to the host at once: the step's one transfer."""
    low, high = torch.aminmax(logits_S_V, dim=-1)  # NaN or an infinity shows in one of them
    finite_S = torch.isfinite(low) & torch.isfinite(high)
    logprobs_S_V = torch.log_softmax(logits_S_V, dim=-1)
    parts = [d.columns(finite_S, logprobs_S_V, chosen_S).reshape(-1) for d in running]
    host = torch.cat(parts).tolist()
    out, at = [], 0
    for part in parts:
        out.append(host[at : at + part.numel()])
        at += part.numel()
    return out


def next_tokens(
    logits_S_V: torch.Tensor,
    draws: list[Draws],
    agree: Callable[[torch.Tensor], torch.Tensor] | None,
    step: int,
) -> torch.Tensor:
    """Every running job's tokens (agreed on), appended to its rows; the tokens every row is
    fed next (a finished, cancelled or failed job's rows: 0). One copy to the host."""
    running = [d for d in draws if not d.finished and not d.cancelled()]
    chosen = torch.zeros(logits_S_V.shape[0], dtype=torch.long, device=logits_S_V.device)
    for d in running:
        chosen[d.start : d.end] = d.choose(logits_S_V)
    if agree is not None:
        chosen = agree(chosen)
    if not running:
        return chosen
    for d, values in zip(running, to_host(logits_S_V, chosen, running), strict=True):
        if not d.take(values, step):
            chosen[d.start : d.end] = 0
    return chosen
