"""A session's generator side: weights-sync, the pending publish, and sampling.

`GeneratorOps` is a mixin of `TrainingSession` (`trainer/engine/session.py`), which supplies the
resource, the policy, the versions and `operation_scope`, the operation scope that restores the
session's RNG stream, step and versions when an operation fails and runs the undo actions the
operation registered. A pending publish (BACKGROUND_PUBLISH, PIPELINE) is applied by swapping
the snapshot into the generator and registering the reverse swap, so a sample that fails
leaves the generator, `applied_weights_version` and `pending_publish` as they were.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from trainer.compute import moe_replay, sampler
from trainer.compute.policy import cuda_devices
from trainer.compute.turns import TurnLock
from trainer.contract.errors import invalid
from trainer.contract.rules import Limits, check_prompts
from trainer.contract.specs import ModelInput, SamplingParams
from trainer.engine.batching.sample_batch import SampleJob, batcher_for
from trainer.engine.moe_replay_keys import issue_keys

if TYPE_CHECKING:
    from trainer.compute.placement import Communicator
    from trainer.compute.policy import Policy
    from trainer.contract.options import EngineOptions
    from trainer.engine.handle import ResourceHandle

SYNC_TYPES = (
    "WEIGHT_SYNC_TYPE_SYNCHRONOUS",
    "WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH",
    "WEIGHT_SYNC_TYPE_PIPELINE",
)

Undo = list[Callable[[], None]]
"""What a failing operation must undo beyond RNG, step and versions, run in reverse order."""


@dataclass
class Versions:
    """Part B §8: trainer_step counts optim-steps; the generator serves `applied`."""

    trainer_step: int = 0
    target_weights_version: int = 0
    applied_weights_version: int = 0
    pending: tuple[dict[str, torch.Tensor], int] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "trainer_step": self.trainer_step,
            "target_weights_version": self.target_weights_version,
            "applied_weights_version": self.applied_weights_version,
            "pending_publish": self.pending is not None,
        }


class GeneratorOps(abc.ABC):
    """Weights-sync and sample, for `TrainingSession`."""

    resource: ResourceHandle
    policy: Policy
    versions: Versions
    options: EngineOptions
    active: bool
    _cpu_rng: torch.Tensor  # the session's CPU RNG state between operations

    @property
    @abc.abstractmethod
    def comm(self) -> Communicator:
        """The ranks the session runs on."""

    @abc.abstractmethod
    def operation_scope(self) -> contextlib.AbstractContextManager[Undo]:
        """The session's operation context (lock, RNG, undo on failure)."""

    def weights_sync(self, sync_type: str) -> dict[str, Any]:
        """SYNCHRONOUS: live on return. BACKGROUND_PUBLISH and PIPELINE: a snapshot is queued
        and the next sample applies it before generating (`pending_publish` until then)."""
        if sync_type not in SYNC_TYPES:
            raise invalid("weight_sync_type", f"must be one of {', '.join(SYNC_TYPES)}")
        self._require_generator()
        with self.operation_scope():
            version = self.versions.trainer_step
            self.versions.target_weights_version = version
            if sync_type == "WEIGHT_SYNC_TYPE_SYNCHRONOUS":
                self.policy.publish()  # the last step: nothing after it can fail
                self.versions.applied_weights_version = version
                self.versions.pending = None
            else:
                self.versions.pending = (self.policy.snapshot(), version)
        return {"weights_version": version}

    def _apply_pending(self, undo: Undo) -> None:
        """Serve the queued snapshot; the reverse swap is registered in case the call fails."""
        if self.versions.pending is not None:
            snapshot, version = self.versions.pending
            self.policy.swap_published(snapshot)
            undo.append(lambda: self.policy.swap_published(snapshot))
            self.versions.applied_weights_version = version
            self.versions.pending = None

    def _require_generator(self) -> None:
        if not self.resource.has_generator:
            raise invalid(
                "compute_config.num_generator_replicas",
                "this resource has no generator (0 replicas): sample and weights-sync are off",
            )

    def sample(
        self,
        model_inputs: list[ModelInput],
        *,
        num_samples: int = 1,
        sampling_params: SamplingParams | None = None,
        prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        return_routed_experts: bool = False,
    ) -> dict[str, Any]:
        params = sampling_params or SamplingParams()
        self._require_generator()
        prompts = self._check_prompts(model_inputs, num_samples, params, topk_prompt_logprobs)
        job = SampleJob(
            session=self,
            prompts=prompts,
            num_samples=num_samples,
            params=params,
            eos_ids=self.resource.eos_ids | set(params.stop_token_ids),
            stop_hit=self._stop_checker(params.stop),
            prompt_logprobs=prompt_logprobs,
            topk_prompt_logprobs=topk_prompt_logprobs,
            return_routed_experts=return_routed_experts,
        )
        batcher = batcher_for(self)  # concurrent samples of other sessions: one batch
        if batcher is not None:
            return batcher.run(job)
        return self._sample_alone(job)

    def _sample_alone(self, job: SampleJob) -> dict[str, Any]:
        with self.operation_scope() as undo, self._resharding():
            self._apply_pending(undo)
            version = self.versions.applied_weights_version
            with (
                self.policy.published() as model,
                moe_replay.recording(model, job.rows, job.return_routed_experts) as recorder,
            ):
                groups = sampler.generate(
                    model,
                    job.prompts,
                    num_samples=job.num_samples,
                    params=job.params,
                    eos_ids=job.eos_ids,
                    stop_hit=job.stop_hit,
                    seed=job.params.seed,
                    forward=self._model_forward(model),
                    agree=self._agree_tokens,
                    give_turn=moe_replay.pausing(recorder, self._turn_giver()),
                    turn_steps=self.options.decode_steps_per_turn,
                )
                if recorder is not None:  # MoE routes (rule 12)
                    moe_replay.assign(recorder, [job.prompts], [groups], [True])
                return self._sample_results(job, groups, version, model)

    def _sample_results(
        self,
        job: SampleJob,
        groups: list[list[sampler.Sequence]],
        version: int,
        model: torch.nn.Module,
    ) -> dict[str, Any]:
        """The call's answer from its generated sequences (grouped by prompt), with prompt
        logprobs computed on `model` (the published weights, active) when asked."""
        results = []
        forward = self._model_forward(model)
        for prompt, group in zip(job.prompts, groups, strict=True):
            keys = issue_keys(self, prompt, group)
            result: dict[str, Any] = {
                "sequences": [
                    {
                        "tokens": seq.tokens,
                        "logprobs": seq.logprobs,
                        "stop_reason": seq.stop_reason,
                        "prompt_cache_hit_tokens": 0,
                        **({"routed_experts_key": key} if key else {}),
                    }
                    for seq, key in zip(group, keys, strict=True)
                ],
                "policy_segments": [{"start_token": 0, "version": version}],
            }
            if job.prompt_logprobs or job.topk_prompt_logprobs:
                lps, top = sampler.prompt_logprobs(
                    model, prompt, job.topk_prompt_logprobs, forward=forward
                )
                if job.prompt_logprobs:
                    result["prompt_logprobs"] = lps
                if job.topk_prompt_logprobs:
                    result["topk_prompt_logprobs"] = top
            results.append(result)
        return {"results": results}

    def _turn_giver(self) -> Callable[[], None] | None:
        """What generation calls every `decode_steps_per_turn` steps: if operations wait for
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
        Off (None) under torchrun: every rank must run the same operations in the same order,
        and the command stream (`distributed/spmd.py`) runs one at a time anyway."""
        lock = self.resource.lock
        if (
            not isinstance(lock, TurnLock)
            or self.options.decode_steps_per_turn <= 0
            or self.comm.world_size > 1
        ):
            return None
        devices = cuda_devices()

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

        return give_turn

    def _model_forward(self, model: torch.nn.Module) -> Callable[..., Any]:
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

    def _check_prompts(
        self,
        model_inputs: list[ModelInput],
        num_samples: int,
        params: SamplingParams,
        topk: int,
    ) -> list[list[int]]:
        """The rulebook's checks of a sample call (`trainer.contract.rules.check_prompts`),
        against the model's limits and vocabulary; the prompts' token ids."""
        limits = Limits.of(self.resource.entry, vocab_size=self.resource.vocab_size)
        return check_prompts(model_inputs, num_samples, params.max_tokens, topk, limits)

    def _stop_checker(self, stops: list[str]) -> Callable[[list[int]], bool] | None:
        if not stops:
            return None
        tokenizer = self.resource.tokenizer
        if tokenizer is None:
            raise invalid(
                "sampling_params.stop", "stop strings need a tokenizer and this model has none"
            )

        def hit(tokens: list[int]) -> bool:
            text = tokenizer.decode(tokens[-32:], skip_special_tokens=False)
            return any(stop in text for stop in stops)

        return hit


def _call_model(model: Any, **kwargs: Any) -> Any:
    return model(**kwargs)
