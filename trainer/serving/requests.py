"""HTTP request bodies, validated once at the edge with messages that name the field.

The shapes are the SDK's (`together.types.post_training.*_params`); the pieces they share with
the engine (samples, losses, optimizer and sampling knobs) come from `trainer.contract`. The
checks of their content against the model's limits are the rulebook's
(`trainer.contract.rules`, with the vocabulary once a resource of the model has loaded); they
run before an operation is queued (`check_forward_backward`, `check_custom`, `check_sample`),
so a bad batch is a 400 and never touches the session.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import Field, model_validator

from trainer.contract.base import Spec
from trainer.contract.embeddings import EmbeddingObjective, check_embedding_call
from trainer.contract.errors import InputError
from trainer.contract.losses import LossConfig
from trainer.contract.optimizer import AdamParams, MuonParams, optimizer_kind
from trainer.contract.rules import (
    MAX_TOPK_PROMPT_LOGPROBS,
    Limits,
    Needs,
    check_gradient,
    check_gradient_count,
    check_prompts,
    check_samples,
    check_target_ids,
    token_values,
)
from trainer.contract.specs import (
    Gradient,
    LoraConfig,
    ModelEntry,
    ModelInput,
    ResourceSpec,
    Sample,
    SamplingParams,
    SessionMetadata,
    SessionSpec,
)
from trainer.serving.errors import ApiError, bad_request

WeightSyncType = Literal[
    "WEIGHT_SYNC_TYPE_SYNCHRONOUS",
    "WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH",
    "WEIGHT_SYNC_TYPE_PIPELINE",
]
CheckpointVariant = Literal["CHECKPOINT_VARIANT_MERGED", "CHECKPOINT_VARIANT_ADAPTER"]


class CreateResourceBody(ResourceSpec):
    """POST /rl/model-resources (and estimate-cost); `optimizer_config` is checked by
    `trainer.contract.optimizer.check_optimizer_config`. `shared`: other users may open
    sessions on it (a LoRA resource; its merged passes then carry several users' work)."""

    shared: bool = False


class ExtendExpiryBody(Spec):
    seconds: int = Field(ge=60, le=86400)


class StopResourceBody(Spec):
    force: bool = False


class CreateSessionBody(SessionSpec):
    model_resources_id: str = Field(min_length=1)


class UpdateSessionBody(Spec):
    """PATCH: omitted fields stay; an empty string clears a field."""

    display_name: str | None = Field(default=None, max_length=128)
    metadata: SessionMetadata | None = None


# `fail_fast`: validation stops at a list's first bad element; a body of a million bad
# samples costs one error, not a million
class ForwardBackwardBody(Spec):
    loss: LossConfig
    samples: list[Sample] = Field(min_length=1, fail_fast=True)
    forward_only: bool = False
    return_loss_fn_outputs: bool = False
    # the Tinker face: per-token logprobs at every position, masked ones included
    logprobs_unmasked: bool = False


class CustomForwardBackwardBody(Spec):
    samples: list[Sample] = Field(min_length=1, fail_fast=True)
    gradients: list[Gradient] = Field(min_length=1, fail_fast=True)

    @model_validator(mode="after")
    def _aligned(self) -> CustomForwardBackwardBody:
        check_gradient_count(len(self.gradients), len(self.samples))
        for i, (sample, gradient) in enumerate(zip(self.samples, self.gradients, strict=True)):
            check_gradient(i, gradient, len(token_values(sample.model_input)))
        return self


class EmbeddingForwardBackwardBody(Spec):
    """An embedding call (docs/semantics.md §27): the Tinker face builds it, the RL face has no
    route for it."""

    samples: list[Sample] = Field(min_length=1, fail_fast=True)
    objective: EmbeddingObjective
    forward_only: bool = False
    gradients: list[Gradient] | None = Field(default=None, fail_fast=True)


class OptimStepBody(Spec):
    """The params of the resource's optimizer (`check_optimizer_params`); none: defaults."""

    adam_params: AdamParams | None = None
    muon_params: MuonParams | None = None

    @model_validator(mode="before")
    @classmethod
    def _one_clip(cls, data: Any) -> Any:
        """A Muon step clips every tensor together (`muon_params.grad_clip_norm`)."""
        muon = data.get("muon_params") if isinstance(data, dict) else None
        adam = muon.get("adam") if isinstance(muon, dict) else None
        if isinstance(adam, dict) and "grad_clip_norm" in adam:
            raise ValueError(
                "muon_params.adam.grad_clip_norm: a Muon step clips all tensors together; set "
                "muon_params.grad_clip_norm"
            )
        return data

    @model_validator(mode="after")
    def _one_optimizer(self) -> OptimStepBody:
        if self.muon_params is not None and self.adam_params is not None:
            raise ValueError("muon_params: send adam_params or muon_params, not both")
        return self


def check_optimizer_params(body: OptimStepBody, optimizer_config: dict[str, Any]) -> None:
    """A 400 naming the field when the params are not those of the resource's optimizer."""
    kind = optimizer_kind(optimizer_config)
    if kind == "adam" and body.muon_params is not None:
        raise bad_request(
            "muon_params: this session's resource uses Adam; send adam_params", "muon_params"
        )
    if kind == "muon" and body.adam_params is not None:
        raise bad_request(
            "adam_params: this session's resource uses Muon; send muon_params (its adam field "
            "sets the AdamW tensors)",
            "adam_params",
        )


class WeightsSyncBody(Spec):
    weight_sync_type: WeightSyncType


class SampleBody(Spec):
    model_inputs: list[ModelInput] = Field(min_length=1, fail_fast=True)
    num_samples: int = Field(default=1, ge=1, le=1024)
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = Field(default=0, ge=0, le=MAX_TOPK_PROMPT_LOGPROBS)
    return_routed_experts: bool = False
    # each token's logprob under the distribution it was drawn from (docs/semantics.md)
    sampling_logprobs: bool = False
    # per prompt, [len(prompt) - 1, K] ids to score at positions 1.. (-1: none)
    target_prompt_ids: list[list[list[int]]] | None = None
    # per prompt position after the first, k draws from the model's distribution there
    prompt_alt_tokens_k: int = Field(default=0, ge=0, le=MAX_TOPK_PROMPT_LOGPROBS)


class EmptyBody(Spec):
    """The checkpoint operations take no body."""


@contextlib.contextmanager
def _as_400() -> Iterator[None]:
    """A rule's refusal (`trainer.contract.rules`) as a 400 naming its field."""
    try:
        yield
    except InputError as exc:
        raise bad_request(exc.message, exc.field) from None


def check_forward_backward(
    body: ForwardBackwardBody, entry: ModelEntry, vocab_size: int | None = None
) -> None:
    """The samples against the model's limits (token ids against its vocabulary where it is
    known) and what the loss reads (`LOSS_SPECS`: its inputs and the rules its params bring),
    as a 400 naming the field."""
    loss = body.loss
    needs = Needs.of_loss(loss.type, loss.params())
    with _as_400():
        check_samples(body.samples, Limits.of(entry, vocab_size), needs)


def check_custom(
    body: CustomForwardBackwardBody, entry: ModelEntry, vocab_size: int | None = None
) -> None:
    needs = Needs(by="custom-forward-backward")
    with _as_400():
        check_samples(body.samples, Limits.of(entry, vocab_size), needs)


def check_embedding(
    body: EmbeddingForwardBackwardBody, entry: ModelEntry, vocab_size: int | None = None
) -> None:
    with _as_400():
        check_embedding_call(
            body.samples,
            body.objective,
            body.forward_only,
            body.gradients,
            Limits.of(entry, vocab_size),
        )


def check_sample(body: SampleBody, entry: ModelEntry, vocab_size: int | None = None) -> None:
    """Sequence count, `max_tokens`, the call's token total and the prompts' token ids against
    the model's limits (and its vocabulary, where it is known)."""
    with _as_400():
        check_prompts(
            body.model_inputs,
            body.num_samples,
            body.sampling_params.max_tokens,
            body.topk_prompt_logprobs,
            Limits.of(entry, vocab_size),
        )
        if body.target_prompt_ids is not None:
            lengths = [len(token_values(m)) for m in body.model_inputs]
            check_target_ids(body.target_prompt_ids, lengths, vocab_size)


def check_lora(lora: LoraConfig | None, entry: ModelEntry, lora_enabled: bool) -> None:
    if lora is None:
        return
    if not lora_enabled:
        raise ApiError(
            400,
            "lora_config: the model resource is full-weight (lora_enabled false)",
            param="lora_config",
            code="invalid_input",
        )
    if lora.rank > entry.max_lora_rank:
        raise bad_request(
            f"lora_config.rank: {lora.rank} exceeds max_rank {entry.max_lora_rank} of {entry.name}",
            "lora_config.rank",
        )


def overlay_metadata(current: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """PATCH semantics per section (`wandb`): given fields replace, "" clears, omitted stay."""
    merged = dict(current)
    for key, value in patch.items():
        if isinstance(value, dict):
            section = dict(merged.get(key) or {})
            for field, item in value.items():
                if item == "":
                    section.pop(field, None)
                elif item is not None:
                    section[field] = item
            merged[key] = section
    return merged
