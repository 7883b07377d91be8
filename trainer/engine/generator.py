"""A session's generator: what serves its samples, and the weights-sync and sample operations.

Design notes: `docs/design/engine.md`.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from trainer.compute.grammar import Compiled
from trainer.compute.moe_replay import expert_count
from trainer.compute.prompt_scores import ExtraScores, PromptExtras
from trainer.compute.sampler import DecodeJob, SampleWatch, Sequence, StopCheck, draw_seed
from trainer.contract.errors import invalid
from trainer.contract.grammar import OutputGrammar
from trainer.contract.routing import encode
from trainer.contract.rules import (
    Limits,
    check_alt_k,
    check_last_n,
    check_prompts,
    check_target_ids,
)
from trainer.contract.specs import ModelInput, SamplingParams
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

Weights = dict[str, torch.Tensor]
"""A policy's weights by canonical name (`trainer/compute/policy.py`)."""


@dataclass
class Versions:
    """docs/semantics.md §8: trainer_step counts optim-steps; the generator serves `applied`."""

    trainer_step: int = 0
    target_weights_version: int = 0
    applied_weights_version: int = 0
    pending: tuple[Weights, int] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "trainer_step": self.trainer_step,
            "target_weights_version": self.target_weights_version,
            "applied_weights_version": self.applied_weights_version,
            "pending_publish": self.pending is not None,
        }


@dataclass
class SampleCall:
    """One validated sample call. `steps_per_turn`: its session's `decode_steps_per_turn`;
    `prompt_logprobs_last_n`: score only each prompt's last N tokens (None: all of them).
    `sampling_logprobs`, `watch`: `DecodeJob`'s; `target_prompt_ids` (a table per prompt),
    `prompt_alt_tokens_k`: `prompt_scores.PromptExtras`'."""

    prompts: list[list[int]]
    num_samples: int
    params: SamplingParams
    eos_ids: set[int]
    stop_hit: StopCheck | None
    prompt_logprobs: bool
    topk_prompt_logprobs: int
    return_routed_experts: bool = False
    # the routes inline, as routing matrices per sequence (the completions face's R3)
    return_routing_matrices: bool = False
    steps_per_turn: int = 0
    prompt_logprobs_last_n: int | None = None
    sampling_logprobs: bool = False
    target_prompt_ids: list[list[list[int]]] | None = None
    prompt_alt_tokens_k: int = 0
    watch: SampleWatch | None = None
    grammar: Compiled | None = None  # what the samples' text must match (§17.2)

    @property
    def rows(self) -> int:
        return len(self.prompts) * self.num_samples

    @property
    def records_routes(self) -> bool:
        """Whether the generation records MoE routes (as keys, inline, or both)."""
        return self.return_routed_experts or self.return_routing_matrices

    @property
    def prompt_side(self) -> bool:
        """Whether the call asks anything of its prompts (computed apart from generation)."""
        return bool(
            self.prompt_logprobs
            or self.topk_prompt_logprobs
            or self.target_prompt_ids is not None
            or self.prompt_alt_tokens_k
        )

    def prompt_extras(self, i: int, seed: int | None) -> PromptExtras | None:
        """Prompt `i`'s target ids and draws, if asked; the draws come from a generator
        seeded apart from the decode's (`seed`: the call's; None: its own, or drawn)."""
        targets = None if self.target_prompt_ids is None else self.target_prompt_ids[i]
        if targets is None and not self.prompt_alt_tokens_k:
            return None
        base = draw_seed(self.params.seed if seed is None else seed)
        generator = torch.Generator().manual_seed((base ^ ALT_SEED_MIX) + i)
        return PromptExtras(targets, self.prompt_alt_tokens_k, self.params.temperature, generator)

    def decode_job(self, seed: int, adapter: str | None = None) -> DecodeJob:
        """The call's rows in a generation (`trainer/compute/sampler.py`)."""
        return DecodeJob(
            prompts=self.prompts,
            num_samples=self.num_samples,
            params=self.params,
            eos_ids=self.eos_ids,
            seed=seed,
            stop_hit=self.stop_hit,
            adapter=adapter,
            record_routed_experts=self.records_routes,
            sampling_logprobs=self.sampling_logprobs,
            watch=self.watch,
            grammar=None if self.grammar is None else self.grammar.rows(self.rows),
        )


ALT_SEED_MIX = 0x2545F4914F6CDD1D
"""Mixed into a call's seed for its prompt-side draws, apart from the decode's stream."""

PromptLogprobs = tuple[list[float | None], list[dict[str, list]]]
"""A prompt's token logprobs and top-k alternatives (`sampler.prompt_logprobs`)."""


@dataclass
class PromptSamples:
    """One prompt's sequences, and its prompt logprobs and extras when the call asked."""

    sequences: list[Sequence]
    prompt_logprobs: PromptLogprobs | None = None
    extras: ExtraScores | None = None


class SamplingSession(Protocol):
    """What the sample and weights-sync operations use of their session (`TrainingSession`)."""

    id: str
    resource: ResourceHandle
    policy: Policy
    generator: Generator
    versions: Versions
    options: EngineOptions
    active: bool
    cpu_rng: torch.Tensor  # the session's CPU RNG state between operations

    @property
    def comm(self) -> Communicator:
        """The ranks the session runs on."""

    def operation_scope(self) -> contextlib.AbstractContextManager[Undo]:
        """The session's operation context (lock, RNG, undo on failure)."""


class Generator(abc.ABC):
    """What serves one session's samples (the module docstring)."""

    def __init__(self, resource: ResourceHandle) -> None:
        self.resource = resource

    @abc.abstractmethod
    def publish(self) -> None:
        """Serve the policy's trainable weights as they are now."""

    @abc.abstractmethod
    def snapshot(self) -> Weights:
        """A copy of the trainable weights as they are now, to be served later (`serve`)."""

    @abc.abstractmethod
    def serve(self, snapshot: Weights) -> Callable[[], None]:
        """Serve `snapshot` from now on; returns what serves the weights served before again."""

    @abc.abstractmethod
    def generate(self, call: SampleCall, seed: int) -> list[PromptSamples]:
        """In the session's operation: each prompt's `num_samples` sequences on the served
        weights, their token choices drawn from a generator seeded with `seed`."""

    def close(self) -> None:  # noqa: B027 - most generators hold nothing of their own
        """Release what serving this session's samples holds (nothing, unless replicas)."""

    def sample(self, session: SamplingSession, call: SampleCall) -> dict[str, Any]:
        """The sample operation's answer: the call alone, or, where this generator batches
        concurrent sessions' samples, with them."""
        return sample_alone(session, call)

    def sample_call(
        self,
        model_inputs: list[ModelInput],
        num_samples: int,
        params: SamplingParams,
        *,
        prompt_logprobs: bool,
        topk_prompt_logprobs: int,
        return_routed_experts: bool,
        steps_per_turn: int,
        return_routing_matrices: bool = False,
        prompt_logprobs_last_n: int | None = None,
        sampling_logprobs: bool = False,
        target_prompt_ids: list[list[list[int]]] | None = None,
        prompt_alt_tokens_k: int = 0,
        watch: SampleWatch | None = None,
        grammar: OutputGrammar | None = None,
    ) -> SampleCall:
        """A sample call, validated (INVALID_INPUT naming the field) before any state moves."""
        self.require()
        prompts = self._check_prompts(model_inputs, num_samples, params, topk_prompt_logprobs)
        check_last_n(prompt_logprobs_last_n, [len(p) for p in prompts], prompt_logprobs)
        check_alt_k(prompt_alt_tokens_k)
        vocab = self.resource.vocab_size
        check_target_ids(target_prompt_ids, [len(p) for p in prompts], vocab)
        eos_ids = self.resource.eos_ids | set(params.stop_token_ids)
        compiled = None
        if grammar is not None:
            try:
                compiled = Compiled(grammar, self.resource.tokenizer, vocab, eos_ids)
            except ValueError as exc:
                raise invalid(grammar.field, str(exc)) from None
        return SampleCall(
            prompts=prompts,
            num_samples=num_samples,
            params=params,
            eos_ids=eos_ids,
            stop_hit=self._stop_checker(params.stop),
            prompt_logprobs=prompt_logprobs,
            topk_prompt_logprobs=topk_prompt_logprobs,
            return_routed_experts=return_routed_experts,
            return_routing_matrices=return_routing_matrices,
            steps_per_turn=steps_per_turn,
            prompt_logprobs_last_n=prompt_logprobs_last_n,
            sampling_logprobs=sampling_logprobs,
            target_prompt_ids=target_prompt_ids,
            prompt_alt_tokens_k=prompt_alt_tokens_k,
            watch=watch,
            grammar=compiled,
        )

    def require(self) -> None:
        """Refuse sample and weights-sync on a resource without a generator."""
        if not self.resource.has_generator:
            raise invalid(
                "compute_config.num_generator_replicas",
                "this resource has no generator (0 replicas): sample and weights-sync are off",
            )

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


def sync_weights(session: SamplingSession, sync_type: str) -> dict[str, Any]:
    """The weights-sync operation: SYNCHRONOUS is live on return; BACKGROUND_PUBLISH and
    PIPELINE queue a snapshot that the next sample serves first (`pending_publish` until
    then)."""
    if sync_type not in SYNC_TYPES:
        raise invalid("weight_sync_type", f"must be one of {', '.join(SYNC_TYPES)}")
    session.generator.require()
    with session.operation_scope():
        version = session.versions.trainer_step
        session.versions.target_weights_version = version
        if sync_type == "WEIGHT_SYNC_TYPE_SYNCHRONOUS":
            session.generator.publish()  # the last step: nothing after it can fail
            session.versions.applied_weights_version = version
            session.versions.pending = None
        else:
            session.versions.pending = (session.generator.snapshot(), version)
    return {"weights_version": version}


def apply_pending(session: SamplingSession, undo: Undo) -> None:
    """Serve the queued snapshot; what serves the previous weights again goes to `undo`."""
    if session.versions.pending is not None:
        snapshot, version = session.versions.pending
        undo.append(session.generator.serve(snapshot))
        session.versions.applied_weights_version = version
        session.versions.pending = None


def sample_alone(session: SamplingSession, call: SampleCall) -> dict[str, Any]:
    """The sample operation of one session's call, in its operation scope: the pending
    publish served, the seed (when the call gives none) drawn from the session's RNG stream."""
    with session.operation_scope() as undo:
        apply_pending(session, undo)
        version = session.versions.applied_weights_version
        samples = session.generator.generate(call, draw_seed(call.params.seed))
        return answer(session, call, samples, version)


def answer(
    session: SamplingSession, call: SampleCall, samples: list[PromptSamples], version: int
) -> dict[str, Any]:
    """The sample operation's result: per prompt its sequences (with their routing-replay keys
    or routing matrices when asked, their sampling and top logprobs when asked), the weights
    version they come from, its prompt logprobs and extras when asked."""
    results = []
    experts = expert_count(session.policy.model) if call.return_routing_matrices else 0
    for prompt, got in zip(call.prompts, samples, strict=True):
        keys: list[str | None] = [None] * len(got.sequences)
        if call.return_routed_experts:
            keys = issue_keys(session, prompt, got.sequences)
        result: dict[str, Any] = {
            "sequences": [
                {
                    "tokens": seq.tokens,
                    "logprobs": seq.logprobs,
                    "stop_reason": seq.stop_reason,
                    "prompt_cache_hit_tokens": 0,
                    **({"routed_experts_key": key} if key else {}),
                    **_asked(call, seq, experts),
                }
                for seq, key in zip(got.sequences, keys, strict=True)
            ],
            "policy_segments": [{"start_token": 0, "version": version}],
        }
        if got.prompt_logprobs is not None:
            lps, top = got.prompt_logprobs
            if call.prompt_logprobs:
                result["prompt_logprobs"] = lps
            if call.topk_prompt_logprobs:
                result["topk_prompt_logprobs"] = top
        extras = got.extras
        if extras is not None and extras.target_logprobs is not None:
            result["target_prompt_logprobs"] = extras.target_logprobs
        if extras is not None and extras.alt_tokens is not None:
            result["prompt_alt_tokens"] = {
                "token_ids": extras.alt_tokens,
                "logprobs": extras.alt_logprobs,
            }
        results.append(result)
    return {"results": results}


def _asked(call: SampleCall, seq: Sequence, experts: int = 0) -> dict[str, Any]:
    """A sequence's sampling and top logprobs, and its routing matrices (one per position the
    generator ran: the prompt and every completion token but the last), where the call asked
    for them."""
    out: dict[str, Any] = {}
    if call.return_routing_matrices and seq.routed_experts is not None:
        out["routing_matrices"] = encode(seq.routed_experts.numpy(), experts)
    if call.sampling_logprobs:
        out["sampling_logprobs"] = seq.sampling_logprobs
    if call.params.top_logprobs:
        out["top_logprobs"] = seq.top_logprobs
    return out
