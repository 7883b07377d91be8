"""The in-process generator: a session's samples from its policy's published weights, on the
resource's model in this process.

Publishing copies the trainable weights into the policy's published copy (`Policy.publish`). A
snapshot is served by exchanging it in place with the published weights
(`Policy.swap_published`), so exchanging them again undoes it, bit for bit, with no second copy.
A sample generates under `policy.published()` (the published weights active, in eval mode) as
one job of the decode loop (`trainer/compute/sampler.py`), calling the model through the
placement (the FSDP root, sharded), with rank 0's tokens on every rank, and frees what its
forwards left gathered however it ends. Concurrent samples of a LoRA resource's sessions run
as one generation where `batcher_for` allows (`trainer/engine/batching/sample_batch.py`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from trainer.compute import prompt_scores, sampler
from trainer.compute.policy import cuda_devices
from trainer.compute.turns import TurnLock
from trainer.engine.batching.sample_batch import SampleJob, batcher_for
from trainer.engine.generator import (
    Generator,
    PromptSamples,
    SampleCall,
    SamplingSession,
    Weights,
)

if TYPE_CHECKING:
    from trainer.compute.policy import Policy
    from trainer.engine.handle import ResourceHandle


class InProcessGenerator(Generator):
    """The module docstring."""

    def __init__(self, resource: ResourceHandle, policy: Policy) -> None:
        super().__init__(resource)
        self.policy = policy

    def publish(self) -> None:
        self.policy.publish()

    def snapshot(self) -> Weights:
        return self.policy.snapshot()

    def serve(self, snapshot: Weights) -> Callable[[], None]:
        self.policy.swap_published(snapshot)
        return lambda: self.policy.swap_published(snapshot)

    def sample(self, session: SamplingSession, call: SampleCall) -> dict[str, Any]:
        batcher = batcher_for(session)  # concurrent samples of other sessions: one batch
        if batcher is not None:
            return batcher.run(SampleJob(session=session, call=call, generator=self))
        return super().sample(session, call)

    @torch.no_grad()  # else autograd keeps every decode step's graph: O(tokens^2) memory
    def generate(self, call: SampleCall, seed: int) -> list[PromptSamples]:
        with self._resharding(), self.policy.published() as model:
            (groups,) = sampler.generate(
                model,
                [call.decode_job(seed)],
                forward=self.forward(model),
                agree=self._agree_tokens,
                turns=self._turns(call.steps_per_turn),
            )
            return self.prompt_samples(call, groups, model, seed)

    def prompt_samples(
        self,
        call: SampleCall,
        groups: list[list[sampler.Sequence]],
        model: nn.Module,
        seed: int | None = None,
    ) -> list[PromptSamples]:
        """Each prompt's sequences, with its prompt logprobs and extras (target ids, draws
        seeded from `seed`: `SampleCall.prompt_extras`) computed on `model` (the published
        weights, active) when the call asks for them."""
        forward = self.forward(model)
        samples = []
        for i, (prompt, group) in enumerate(zip(call.prompts, groups, strict=True)):
            got = PromptSamples(group)
            if call.prompt_logprobs or call.topk_prompt_logprobs:
                got.prompt_logprobs = sampler.prompt_logprobs(
                    model, prompt, call.topk_prompt_logprobs, forward, call.prompt_logprobs_last_n
                )
            extras = call.prompt_extras(i, seed)
            if extras is not None:
                got.extras = prompt_scores.prompt_extras(model, prompt, extras, forward)
            samples.append(got)
        return samples

    def forward(self, model: nn.Module) -> sampler.Forward:
        """How generation calls the model: through the placement (the FSDP root, sharded)."""
        placement = self.resource.placement

        def forward(**kwargs: Any) -> Any:
            return placement.run(model, _call_model, **kwargs)

        return forward

    def _agree_tokens(self, chosen_S: torch.Tensor) -> torch.Tensor:
        """The tokens every rank continues with: rank 0's."""
        return self.resource.comm.broadcast_(chosen_S.contiguous())

    @contextlib.contextmanager
    def _resharding(self) -> Iterator[None]:
        """Generation only runs forwards: free what they leave gathered, however it ends."""
        try:
            yield
        finally:
            self.resource.placement.reshard()

    def _turns(self, steps: int) -> sampler.Turns:
        """What generation does every `decode_steps_per_turn` steps: if operations wait for
        the compute lock (`trainer/compute/turns.py`), they run now and the sample resumes after
        them.

        What the sample relies on and another session's operation may change is put back on
        resuming: its published adapter as the active one, eval mode (re-entering
        `policy.published()`), and the global RNG state (its session's stream, which a model
        load in between could draw from). The KV cache, the logits and the token generator are
        the sample's own, and what they were computed from cannot change meanwhile: the base
        weights are frozen (LoRA) or another resource's (a full-weight resource hosts one
        session), and only this session's own operations change its published weights
        (weights-sync, a pending publish, resume), and those wait behind this sample in the
        session's FIFO (`SessionQueue`); a session is closed only from that queue too. So the
        sequence comes from one weights version: `policy_segments` stays one segment.
        Never under torchrun: every rank must run the same operations in the same order,
        and the command stream (`distributed/spmd.py`) runs one at a time anyway."""
        lock = self.resource.lock
        if not isinstance(lock, TurnLock) or steps <= 0 or self.resource.comm.world_size > 1:
            return sampler.Turns()
        devices = cuda_devices(self.resource.device)

        def give_turn() -> None:
            cpu = torch.get_rng_state()
            cuda = [torch.cuda.get_rng_state(i) for i in devices]
            if not lock.yield_turn():
                return
            torch.set_rng_state(cpu)
            for i, state in zip(devices, cuda, strict=True):
                torch.cuda.set_rng_state(state, i)
            with self.policy.published():
                pass  # activates the published weights again, in eval mode

        return sampler.Turns(steps, give_turn)


def _call_model(model: Any, **kwargs: Any) -> Any:
    return model(**kwargs)
