"""Concurrent samples of several LoRA sessions of one resource, generated as one batch.

Design notes: `docs/design/batching.md`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch import nn

from trainer.compute import sampler
from trainer.compute.policy import LoraPolicy, Policy
from trainer.compute.turns import TurnLock
from trainer.contract.errors import OperationError
from trainer.engine.batching.combine import Combiner, one_per_session
from trainer.engine.batching.eligibility import can_share
from trainer.engine.generator import (
    PromptSamples,
    SampleCall,
    SamplingSession,
    Undo,
    Versions,
    answer,
    apply_pending,
    sample_alone,
)

if TYPE_CHECKING:
    from trainer.contract.specs import ModelEntry


class BatchGenerator(Protocol):
    """What a batch uses of a job's generator (`trainer/engine/in_process.py`)."""

    policy: Policy

    def prompt_samples(
        self, call: SampleCall, groups: list[list[sampler.Sequence]], model: nn.Module
    ) -> list[PromptSamples]:
        """Each prompt's sequences and, when asked, its prompt logprobs on `model`."""


@dataclass
class SampleJob:
    """One validated sample call of one session, then its outcome (`finished` once it has
    one). `result`, `error`, `taken`, `done`: the combiner's view of it (`combine.Item`):
    `result` is set once the job has its outcome or runs in a batch's generation thread."""

    session: SamplingSession
    call: SampleCall
    generator: BatchGenerator
    outcome: dict[str, Any] | None = None
    failure: BaseException | None = None
    finished: threading.Event = field(default_factory=threading.Event)
    result: object = None
    error: BaseException | None = None
    taken: bool = False
    done: bool = False
    # set while the batch runs
    seed: int = 0
    rng_after: torch.Tensor | None = None
    undo: Undo = field(default_factory=list)
    saved_versions: Versions | None = None
    samples: list[PromptSamples] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return self.call.rows

    @property
    def lora(self) -> LoraPolicy:
        """The session's policy: a LoRA one (`batcher_for`)."""
        return cast(LoraPolicy, self.generator.policy)

    def finish(
        self, outcome: dict[str, Any] | None = None, failure: BaseException | None = None
    ) -> None:
        """Its outcome (a result or a failure): its caller wakes."""
        self.outcome, self.failure, self.result = outcome, failure, True
        self.finished.set()


class BatchingResource(Protocol):
    """What the batcher uses of its resource (`ModelResource`)."""

    entry: ModelEntry
    sample_batcher: object | None  # a `SampleBatcher`, made by the first sample that may join one

    @property
    def lock(self) -> TurnLock: ...


_MAKING = threading.Lock()  # two sessions' first batchable samples make one batcher


def batcher_for(session: SamplingSession) -> SampleBatcher | None:
    """The resource's batcher when this session's samples may be batched, else None."""
    if not can_share(session, "sample"):
        return None
    resource = session.resource
    with _MAKING:
        batcher = resource.sample_batcher
        if not isinstance(batcher, SampleBatcher):
            batcher = resource.sample_batcher = SampleBatcher(resource)
        return batcher


def sample_counters(resource: BatchingResource) -> dict[str, int]:
    """`sample_batches`: generations that held more than one session's sample;
    `batched_samples`: the samples that ran in those (0 and 0 before any)."""
    batcher = resource.sample_batcher
    if not isinstance(batcher, SampleBatcher):
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
        take turns on the lock. Returns as soon as this job's own rows are done."""
        limit = self.resource.entry.max_batch_size
        self._combiner.submit(
            job,
            job.session.options.merge_window_ms / 1000.0,
            lambda pending: one_per_session(pending, limit, lambda j: j.rows),
            self._execute,
        )
        if job.error is not None and job.result is None:  # the combiner's own failure
            raise job.error
        job.finished.wait()
        if job.failure is not None:
            raise job.failure
        assert job.outcome is not None
        return job.outcome

    def _execute(self, taken: list[SampleJob]) -> None:
        live = []
        for job in taken:
            if job.session.active:
                live.append(job)
            else:
                job.finish(
                    failure=OperationError("SESSION_NOT_ACTIVE", "the session is not running")
                )
        if len(live) == 1:  # the others stopped meanwhile
            self._alone(live[0])
        elif live:
            self._launch(live)

    @staticmethod
    def _alone(job: SampleJob) -> None:
        """The solo path (it takes the lock itself, so its sample yields its turns)."""
        try:
            job.finish(outcome=sample_alone(job.session, job.call))
        except BaseException as exc:
            job.finish(failure=exc)

    def _launch(self, jobs: list[SampleJob]) -> None:
        """The batch's generation in a thread of its own, so that each job's caller returns
        as soon as its rows are done, whichever caller took the jobs."""
        for job in jobs:
            job.result = True  # handed to the generation thread
        thread = threading.Thread(target=self._generation, args=(jobs,), daemon=True)
        try:
            thread.start()
        except BaseException as exc:
            for job in jobs:
                job.finish(failure=exc)
            raise

    def _generation(self, jobs: list[SampleJob]) -> None:
        try:
            with self.resource.lock:  # held once: the batch can yield its turn
                self._batch(jobs)
        except BaseException as exc:  # the lock itself: every job still waiting fails
            _fail_rest(jobs, exc)

    def _batch(self, jobs: list[SampleJob]) -> None:
        """Each job is finished once: when its rows are done, or failed alone (its logits not
        finite, its answer failing: `_Batch.report`); a failure of the generation itself
        fails the jobs not finished yet. A failed job's session is left as it was."""
        batch = _Batch(self, jobs)
        try:
            for job in jobs:
                _begin(job)
            for job in jobs:
                job.samples = _prompt_samples(job)
            _generate(jobs, self._turns(jobs[0]), batch.report)
        except BaseException as exc:
            _fail_rest(jobs, exc)

    def _turns(self, job: SampleJob) -> sampler.Turns:
        """Between decode steps (with the jobs' adapters off the model): let waiting
        operations run, then eval mode again. The published adapter of each job still running
        cannot change meanwhile (`docs/design/batching.md`); a finished job's is no longer
        read."""
        steps = job.call.steps_per_turn
        lock = self.resource.lock
        if steps <= 0:
            return sampler.Turns()
        peft = job.lora.peft

        def give_turn() -> None:
            if lock.yield_turn():
                peft.eval()

        return sampler.Turns(steps, give_turn)


def _begin(job: SampleJob) -> None:
    """What the session's `operation_scope` + solo sample do before generating: apply a pending
    publish (undoable), and seed the job's token generator as `sample_alone` would, from the
    session's RNG stream when no seed is given (kept aside until the job succeeds)."""
    session = job.session
    job.saved_versions = replace(session.versions)
    apply_pending(session, job.undo)
    rng = torch.Generator()
    rng.set_state(session.cpu_rng)
    job.seed = sampler.draw_seed(job.call.params.seed, rng)
    job.rng_after = rng.get_state()


class _Batch:
    """One batch's reports: each job's answer or failure, and the batcher's counters."""

    def __init__(self, batcher: SampleBatcher, jobs: list[SampleJob]) -> None:
        self.batcher, self.jobs = batcher, jobs
        self.counted = False

    def report(
        self, job: int, groups: list[list[sampler.Sequence]], error: OperationError | None
    ) -> None:
        """`sampler.Report`: the job's answer, or its failure with its session rolled back."""
        self._report(self.jobs[job], groups, error)

    def _report(
        self, job: SampleJob, groups: list[list[sampler.Sequence]], error: OperationError | None
    ) -> None:
        if error is not None:
            _roll_back(job)
            job.finish(failure=error)
            return
        try:
            result = _answer(job, groups)
        except BaseException as exc:
            _roll_back(job)
            job.finish(failure=exc)
            return
        assert job.rng_after is not None
        job.session.cpu_rng = job.rng_after
        if not self.counted:
            self.counted = True
            self.batcher.batches += 1
        self.batcher.batched_jobs += 1
        job.finish(outcome=result)


def _fail_rest(jobs: list[SampleJob], exc: BaseException) -> None:
    """Every job not finished yet fails with `exc`, its session rolled back."""
    for job in reversed(jobs):
        if not job.finished.is_set():
            _roll_back(job)
            job.finish(failure=exc)


def _roll_back(job: SampleJob) -> None:
    for action in reversed(job.undo):
        action()
    job.undo.clear()
    if job.saved_versions is not None:
        job.session.versions = job.saved_versions


def _prompt_samples(job: SampleJob) -> list[PromptSamples]:
    """The job's prompts, with their prompt logprobs (when asked) computed with its own
    adapter alone, before the generation; the sequences come when its rows are done."""
    groups: list[list[sampler.Sequence]] = [[] for _ in job.call.prompts]
    with job.generator.policy.published() as model:
        return job.generator.prompt_samples(job.call, groups, model)


@torch.no_grad()
def _generate(jobs: list[SampleJob], turns: sampler.Turns, report: sampler.Report) -> None:
    """One generation in which each job's rows use its session's published adapter; each job
    is reported (`report`) as soon as its rows are done."""
    policy = jobs[0].lora
    policy.peft.eval()
    decode = [job.call.decode_job(job.seed, adapter=job.lora.pub_name) for job in jobs]
    sampler.generate(policy.model, decode, turns=turns, report=report)


def _answer(job: SampleJob, groups: list[list[sampler.Sequence]]) -> dict[str, Any]:
    """The job's result from its sequences and the prompt logprobs computed before."""
    version = job.session.versions.applied_weights_version
    for samples, group in zip(job.samples, groups, strict=True):
        samples.sequences = group
    return answer(job.session, job.call, job.samples, version)
