"""A session's generator side: weights-sync, the pending publish, and sampling.

`GeneratorOps` is a mixin of `TrainingSession` (`trainer/session.py`), which supplies the
resource, the policy, the versions and `_running`, the operation scope that restores the
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

from trainer import sampler
from trainer.errors import invalid
from trainer.specs import ModelInput, SamplingParams

if TYPE_CHECKING:
    from trainer.handle import ResourceHandle
    from trainer.policy import Policy

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

    @abc.abstractmethod
    def _running(self) -> contextlib.AbstractContextManager[Undo]:
        """The session's operation context (lock, RNG, undo on failure)."""

    def weights_sync(self, sync_type: str) -> dict[str, Any]:
        """SYNCHRONOUS: live on return. BACKGROUND_PUBLISH and PIPELINE: a snapshot is queued
        and the next sample applies it before generating (`pending_publish` until then)."""
        if sync_type not in SYNC_TYPES:
            raise invalid("weight_sync_type", f"must be one of {', '.join(SYNC_TYPES)}")
        self._require_generator()
        with self._running():
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
    ) -> dict[str, Any]:
        params = sampling_params or SamplingParams()
        self._require_generator()
        prompts = self._check_prompts(model_inputs, num_samples, params, topk_prompt_logprobs)
        stop_hit = self._stop_checker(params.stop)
        with self._running() as undo, self._resharding():
            self._apply_pending(undo)
            version = self.versions.applied_weights_version
            with self.policy.published() as model:
                forward = self._model_forward(model)
                groups = sampler.generate(
                    model,
                    prompts,
                    num_samples=num_samples,
                    params=params,
                    eos_ids=self.resource.eos_ids | set(params.stop_token_ids),
                    stop_hit=stop_hit,
                    seed=params.seed,
                    forward=forward,
                    agree=self._agree_tokens,
                )
                results = []
                for prompt, group in zip(prompts, groups, strict=True):
                    result: dict[str, Any] = {
                        "sequences": [
                            {
                                "tokens": seq.tokens,
                                "logprobs": seq.logprobs,
                                "stop_reason": seq.stop_reason,
                                "prompt_cache_hit_tokens": 0,
                            }
                            for seq in group
                        ],
                        "policy_segments": [{"start_token": 0, "version": version}],
                    }
                    if prompt_logprobs or topk_prompt_logprobs:
                        lps, top = sampler.prompt_logprobs(
                            model, prompt, topk_prompt_logprobs, forward=forward
                        )
                        if prompt_logprobs:
                            result["prompt_logprobs"] = lps
                        if topk_prompt_logprobs:
                            result["topk_prompt_logprobs"] = top
                    results.append(result)
        return {"results": results}

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
        entry = self.resource.entry
        if not model_inputs:
            raise invalid("model_inputs", "at least one prompt is required")
        if not 1 <= num_samples <= entry.max_batch_size:
            raise invalid("num_samples", f"must be in [1, {entry.max_batch_size}]")
        if len(model_inputs) * num_samples > entry.max_batch_size:
            raise invalid(
                "num_samples",
                f"{len(model_inputs)} prompts x {num_samples} samples exceed "
                f"max_batch_size {entry.max_batch_size}",
            )
        if not 0 <= topk <= 20:
            raise invalid("topk_prompt_logprobs", "must be in [0, 20]")
        prompts = []
        for i, model_input in enumerate(model_inputs):
            tokens = model_input.tokens
            if not tokens:
                raise invalid(f"model_inputs[{i}]", "has no tokens")
            for j, token in enumerate(tokens):
                if not 0 <= token < self.resource.vocab_size:
                    raise invalid(
                        f"model_inputs[{i}].chunks[{j}]",
                        f"token id {token} out of range [0, {self.resource.vocab_size})",
                    )
            if len(tokens) + params.max_tokens > entry.max_seq_length:
                raise invalid(
                    "sampling_params.max_tokens",
                    f"prompt {i} ({len(tokens)} tokens) + max_tokens {params.max_tokens} "
                    f"exceeds the context length {entry.max_seq_length}",
                )
            prompts.append(tokens)
        return prompts

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
