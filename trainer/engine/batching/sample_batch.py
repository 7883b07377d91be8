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
    """One validated sample call of one session, then its outcome."""

    session: SamplingSession
    call: SampleCall
    generator: BatchGenerator
    result: dict[str, Any] | None = None
    error: BaseException | None = None
    taken: bool = False
    done: bool = False
    # set while the batch runs
    seed: int = 0
    rng_after: torch.Tensor | None = None
    undo: Undo = field(default_factory=list)
    saved_versions: Versions | None = None

    @property
    def rows(self) -> int:
        return self.call.rows

    @property
    def lora(self) -> LoraPolicy:
        """The session's policy: a LoRA one (`batcher_for`)."""
        return cast(LoraPolicy, self.generator.policy)


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
        """The solo path (it takes the lock itself, so its sample yields its turns)."""
        try:
            job.result = sample_alone(job.session, job.call)
        except BaseException as exc:
            job.error = exc

    def _batch(self, jobs: list[SampleJob]) -> None:
        started: list[SampleJob] = []
        try:
            for job in jobs:
                started.append(job)
                _begin(job)
            groups = _generate(jobs, self._turns(jobs[0]))
            results = [_answer(job, group) for job, group in zip(jobs, groups, strict=True)]
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

    def _turns(self, job: SampleJob) -> sampler.Turns:
        """Between decode steps (with the jobs' adapters off the model): let waiting
        operations run, then eval mode again. Each job's published adapter cannot change
        meanwhile (the module docstring)."""
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
    session's RNG stream when no seed is given (kept aside until the batch succeeds)."""
    session = job.session
    job.saved_versions = replace(session.versions)
    apply_pending(session, job.undo)
    rng = torch.Generator()
    rng.set_state(session.cpu_rng)
    job.seed = sampler.draw_seed(job.call.params.seed, rng)
    job.rng_after = rng.get_state()


def _roll_back(job: SampleJob) -> None:
    for action in reversed(job.undo):
        action()
    job.undo.clear()
    if job.saved_versions is not None:
        job.session.versions = job.saved_versions


@torch.no_grad()
def _generate(jobs: list[SampleJob], turns: sampler.Turns) -> list[list[list[sampler.Sequence]]]:
    """Each job's sequences grouped by prompt, from one generation in which each job's rows
    use its session's published adapter."""
    policy = jobs[0].lora
    policy.peft.eval()
    decode = [job.call.decode_job(job.seed, adapter=job.lora.pub_name) for job in jobs]
    return sampler.generate(policy.model, decode, turns=turns)


def _answer(job: SampleJob, groups: list[list[sampler.Sequence]]) -> dict[str, Any]:
    """The job's result, its prompt logprobs computed with its own adapter alone."""
    version = job.session.versions.applied_weights_version
    with job.generator.policy.published() as model:
        samples = job.generator.prompt_samples(job.call, groups, model)
    return answer(job.session, job.call, samples, version)
