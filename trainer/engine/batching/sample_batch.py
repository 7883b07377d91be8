"""Concurrent samples of several LoRA sessions of one resource, generated as one batch.

Flat combining, as `trainer/engine/batching/pass_scheduler.py` does for forward-backward. A session
thread with a
validated sample call hands a `SampleJob` to its resource's `SampleBatcher` and blocks until the
job is done. The first waiting thread becomes the combiner: it waits `[engine] merge_window_ms`
for other sessions' samples, then takes the pending jobs (one per session, up to the model's
`max_batch_size` rows in all) and runs them: one job alone by today's path
(`GeneratorOps.sample_alone`), several under the resource lock as one generation batch
(`generate_joint`). Once it has taken its jobs it stops collecting, so jobs that arrive during
a long generation form the next batch (the two generations take turns on the lock,
`trainer/compute/turns.py`).

One batch: every job's rows, left-padded to one width, one KV cache; each job's rows compute
with its own session's published adapter through `trainer.compute.multilora.segmented` (whole rows;
the head, which sees one position per row, with a segment per row). The segmented forwards are
on the model only while the batch computes: taken off before it yields its turn every
`decode_steps_per_turn` decode steps, put back after. Meanwhile nothing the KV cache was
computed from can change: each job's session is blocked in this batch, so its own operations
(the only ones that change its published adapter) wait in its queue. Each job keeps its own
sampling params, stop rules and token generator, seeded as its solo sample seeds it (the given
seed, or one drawn from the session's own RNG stream), and draws for its own rows only, as its
solo sample does. Numbers: tokens, stop reasons and prompt logprobs are those of the solo
sample; the sampled logprobs may differ from it in the last bits (measured up to 1e-6 on CPU in
fp32) when the batch pads a job's rows and the solo call did not (another attention kernel
path), which could in principle change a token drawn right at a probability boundary.

Per session, as `operation_scope` would: a pending publish is applied (and swapped back if the batch
fails), the session's RNG state moves on only when the batch succeeds; a failure of the batch
fails every job in it and leaves each session as it was. A stopped session's job fails alone.

Used where `[engine] batch_samples` is on, for LoRA resources in one process (`Plain`
placement) with at least two live sessions; everything else samples alone.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

import torch

from trainer.compute import moe_replay
from trainer.compute.sampler import (
    STOP_STOP,
    Sequence,
    _cache_kwarg,
    _choose,
    decode_step,
    left_padded,
)
from trainer.contract.errors import OperationError
from trainer.contract.specs import SamplingParams
from trainer.engine.batching.combine import Combiner, one_per_session
from trainer.engine.batching.eligibility import can_share

if TYPE_CHECKING:
    from trainer.compute.turns import TurnLock
    from trainer.contract.specs import ModelEntry

# A sample's session is a `trainer.engine.generator.GeneratorOps` (which imports this module,
# so it is not named here, even for type checking: `tests/test_imports.py` keeps no cycles).
GeneratorOps = Any


@dataclass
class SampleJob:
    """One validated sample call of one session, then its outcome."""

    session: GeneratorOps
    prompts: list[list[int]]
    num_samples: int
    params: SamplingParams
    eos_ids: set[int]
    stop_hit: Callable[[list[int]], bool] | None
    prompt_logprobs: bool
    topk_prompt_logprobs: int
    return_routed_experts: bool = False
    result: dict[str, Any] | None = None
    error: BaseException | None = None
    taken: bool = False
    done: bool = False
    # set while the batch runs
    seed: int = 0
    rng_after: torch.Tensor | None = None
    undo: list[Callable[[], None]] = field(default_factory=list)
    saved_versions: Any = None

    @property
    def rows(self) -> int:
        return len(self.prompts) * self.num_samples


class BatchingResource(Protocol):
    """What the batcher uses of its resource (`ModelResource`)."""

    entry: ModelEntry
    sample_batcher: SampleBatcher | None  # made by the first sample that may join a batch

    @property
    def lock(self) -> TurnLock: ...


_MAKING = threading.Lock()  # two sessions' first batchable samples make one batcher


def batcher_for(session: GeneratorOps) -> SampleBatcher | None:
    """The resource's batcher when this session's samples may be batched, else None."""
    if not can_share(session, "sample"):
        return None
    resource = session.resource
    with _MAKING:
        if resource.sample_batcher is None:
            resource.sample_batcher = SampleBatcher(resource)
        return resource.sample_batcher


def sample_counters(resource: BatchingResource) -> dict[str, int]:
    """`sample_batches`: generations that held more than one session's sample;
    `batched_samples`: the samples that ran in those (0 and 0 before any)."""
    batcher = resource.sample_batcher
    if batcher is None:
        return {"sample_batches": 0, "batched_samples": 0}
    return {"sample_batches": batcher.batches, "batched_samples": batcher.batched_jobs}


class SampleBatcher:
    """One per resource (`BatchingResource.sample_batcher`); counters for tests and metrics."""

    def __init__(self, resource: BatchingResource) -> None:
        self.resource = resource
        self._combiner: Combiner[SampleJob] = Combiner(overlap=True)
        self.batches = 0  # generations of more than one job
        self.batched_jobs = 0

    def run(self, job: SampleJob) -> dict[str, Any]:
        """Later arrivals form the next batch while this one generates (`overlap`): the two
        take turns on the lock."""
        limit = self.resource.entry.max_batch_size
        self._combiner.submit(
            job,
            job.session.options.merge_window_ms / 1000.0,
            lambda pending: one_per_session(pending, limit, lambda j: j.rows),
            self._execute,
        )
        if job.error is not None:
            raise job.error
        assert job.result is not None
        return job.result

    def _execute(self, taken: list[SampleJob]) -> None:
        if len(taken) == 1:
            self._alone(taken[0])
            return
        live = []
        for job in taken:
            if job.session.active:
                live.append(job)
            else:
                job.error = OperationError("SESSION_NOT_ACTIVE", "the session is not running")
        if len(live) == 1:  # the others stopped meanwhile
            self._alone(live[0])
        elif live:
            with self.resource.lock:  # held once: the batch can yield its turn
                self._batch(live)

    @staticmethod
    def _alone(job: SampleJob) -> None:
        """Today's solo path (it takes the lock itself, so its sample yields its turns)."""
        try:
            job.result = job.session.sample_alone(job)
        except BaseException as exc:
            job.error = exc

    def _batch(self, jobs: list[SampleJob]) -> None:
        started: list[SampleJob] = []
        try:
            for job in jobs:
                started.append(job)
                _begin(job)
            model = jobs[0].session.policy.model
            rows = sum(job.rows for job in jobs)
            wanted = any(job.return_routed_experts for job in jobs)
            with moe_replay.recording(model, rows, wanted) as recorder:  # MoE routes (rule 12)
                give_turn = moe_replay.pausing(recorder, self._turn_giver(jobs[0]))
                groups = generate_joint(model, jobs, give_turn)
            if recorder is not None:
                wants = [job.return_routed_experts for job in jobs]
                moe_replay.assign(recorder, [job.prompts for job in jobs], groups, wants)
            results = []
            for job, group in zip(jobs, groups, strict=True):
                session = job.session
                version = session.versions.applied_weights_version
                with session.policy.published() as model:  # prompt logprobs: its adapter alone
                    results.append(session.sample_results(job, group, version, model))
        except BaseException as exc:
            for job in reversed(started):
                _roll_back(job)
                job.error = exc
            return
        for job, result in zip(jobs, results, strict=True):
            assert job.rng_after is not None
            job.session.cpu_rng = job.rng_after
            job.result = result
        self.batches += 1
        self.batched_jobs += len(jobs)

    def _turn_giver(self, job: SampleJob) -> Callable[[], None] | None:
        """Between decode steps (with the segmented forwards off the model): let waiting
        operations run, then eval mode again. Each job's published adapter cannot change
        meanwhile (the module docstring)."""
        steps = job.session.options.decode_steps_per_turn
        lock = self.resource.lock
        if steps <= 0:
            return None
        peft = job.session.policy.peft  # type: ignore[attr-defined]

        def give_turn() -> None:
            if lock.yield_turn():
                peft.eval()

        return give_turn


def _begin(job: SampleJob) -> None:
    """What the session's `operation_scope` + solo sample do before generating: apply a pending
    publish (undoable), and seed the job's token generator as `sampler.generate` would, from
    the session's RNG stream when no seed is given (kept aside until the batch succeeds)."""
    session = job.session
    job.saved_versions = replace(session.versions)
    session.apply_pending(job.undo)
    state = session.cpu_rng
    rng = torch.Generator()
    rng.set_state(state)
    if job.params.seed is None:
        job.seed = int(torch.randint(0, 2**62, (), generator=rng).item())
    else:
        job.seed = int(job.params.seed)
    job.rng_after = rng.get_state()


def _roll_back(job: SampleJob) -> None:
    for action in reversed(job.undo):
        action()
    job.undo.clear()
    if job.saved_versions is not None:
        job.session.versions = job.saved_versions


@torch.no_grad()
def generate_joint(
    model: Any, jobs: list[SampleJob], give_turn: Callable[[], None] | None
) -> list[list[list[Sequence]]]:
    """Each job's completions (grouped by prompt, as `sampler.generate` returns them), from
    one batch in which each job's rows use its session's published adapter."""
    from transformers import DynamicCache

    from trainer.compute.multilora import Segment, segmented

    peft = jobs[0].session.policy.peft  # type: ignore[attr-defined]
    head = model.get_output_embeddings()
    head_adapters = set(getattr(head, "lora_A", {}))  # sessions without train_unembed: none
    device = next(model.parameters()).device
    rows: list[list[int]] = []
    spans: list[tuple[int, int]] = []
    for job in jobs:
        first = len(rows)
        rows.extend(prompt for prompt in job.prompts for _ in range(job.num_samples))
        spans.append((first, len(rows)))
    adapters = [job.session.policy.pub_name for job in jobs]  # type: ignore[attr-defined]
    input_ids, attention, positions = left_padded(rows, device)
    generators = [torch.Generator().manual_seed(job.seed) for job in jobs]
    cache_kw = {_cache_kwarg(model): DynamicCache()}

    last = [Segment(a if a in head_adapters else None, s, e) for a, (s, e) in zip(adapters, spans)]
    installed = contextlib.ExitStack()  # the decode steps' forwards, kept between yields

    def install(length: int) -> None:
        """Each job's rows (`length` positions each) with its adapter; the head per row."""
        peft.eval()
        body = [Segment(a, s * length, e * length) for a, (s, e) in zip(adapters, spans)]
        installed.enter_context(segmented(model, body))
        installed.enter_context(segmented(head, last))

    try:
        install(input_ids.shape[1])
        out = model(
            input_ids=input_ids,
            attention_mask=attention,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **cache_kw,
        )
        installed.close()
        install(1)  # a decode step: one position per row, for the body and the head alike
        return _decode(
            model,
            jobs,
            spans,
            out,
            attention,
            positions,
            cache_kw,
            install,
            installed,
            generators,
            give_turn,
        )
    finally:
        installed.close()


def _decode(
    model: Any,
    jobs: list[SampleJob],
    spans: list[tuple[int, int]],
    out: Any,
    attention: torch.Tensor,
    positions: torch.Tensor,
    cache_kw: dict[str, Any],
    install: Callable[[int], None],
    installed: contextlib.ExitStack,
    generators: list[torch.Generator],
    give_turn: Callable[[], None] | None,
) -> list[list[list[Sequence]]]:
    """The decode loop of `generate_joint`: each job draws for its own rows, as
    `sampler.generate` does for one call. The segmented forwards are taken off the model
    while the batch yields its turn, and put back after."""
    rows = spans[-1][1]
    steps_per_turn = jobs[0].session.options.decode_steps_per_turn
    sequences = [Sequence() for _ in range(rows)]
    done = torch.zeros(rows, dtype=torch.bool)
    finished = [False] * len(jobs)
    next_pos = positions[:, -1:] + 1
    for step in range(max(job.params.max_tokens for job in jobs)):
        if give_turn is not None and steps_per_turn > 0 and step > 0 and step % steps_per_turn == 0:
            installed.close()
            give_turn()
            install(1)
        logits = out.logits[:, -1, :].float()
        chosen = torch.zeros(rows, dtype=torch.long, device=logits.device)
        for j, job in enumerate(jobs):
            if finished[j]:
                continue
            start, end = spans[j]
            own = logits[start:end]
            logprobs = torch.log_softmax(own, dim=-1)
            picked = _choose(own, job.params, generators[j])
            chosen[start:end] = picked
            picked_lp = logprobs.gather(-1, picked[:, None]).squeeze(-1).cpu()
            for r in range(start, end):
                if done[r]:
                    continue
                token = int(picked[r - start])
                seq = sequences[r]
                seq.tokens.append(token)
                seq.logprobs.append(float(picked_lp[r - start]))
                if token in job.eos_ids or (job.stop_hit is not None and job.stop_hit(seq.tokens)):
                    seq.stop_reason = STOP_STOP
                    done[r] = True
            max_tokens = job.params.max_tokens
            if (
                bool(done[start:end].all())
                or len(sequences[start].tokens) >= max_tokens
                or step + 1 >= max_tokens
            ):
                finished[j] = True
        if all(finished):
            break
        out, attention, next_pos = decode_step(model, chosen, attention, next_pos, cache_kw)
    grouped = []
    for job, (start, _) in zip(jobs, spans):
        mine = sequences[start : start + job.rows]
        n = job.num_samples
        grouped.append([mine[i * n : (i + 1) * n] for i in range(len(job.prompts))])
    return grouped
