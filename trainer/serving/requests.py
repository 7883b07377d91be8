"""HTTP request bodies, validated once at the edge with messages that name the field.

The shapes are the SDK's (`together.types.post_training.*_params`); the pieces they share with
the engine (samples, losses, optimizer and sampling knobs) come from `trainer.contract.specs`.
Checks
that need the model's limits (`check_samples`) run before an operation is queued, so a bad
batch is a 400 and never touches the session.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from pydantic import Field, model_validator

from trainer.contract.losses import LOSS_INPUTS, LossConfig
from trainer.contract.optimizer import AdamParams, MuonParams, optimizer_kind
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
    Spec,
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
    `trainer.contract.optimizer.check_optimizer_config`."""


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


class ForwardBackwardBody(Spec):
    loss: LossConfig
    samples: list[Sample] = Field(min_length=1)
    forward_only: bool = False
    return_loss_fn_outputs: bool = False
    # the Tinker face: per-token logprobs at every position, masked ones included
    logprobs_unmasked: bool = False


class CustomForwardBackwardBody(Spec):
    samples: list[Sample] = Field(min_length=1)
    gradients: list[Gradient] = Field(min_length=1)

    @model_validator(mode="after")
    def _aligned(self) -> CustomForwardBackwardBody:
        if len(self.gradients) != len(self.samples):
            raise ValueError(
                f"gradients has {len(self.gradients)} entries for {len(self.samples)} samples"
            )
        for i, (sample, gradient) in enumerate(zip(self.samples, self.gradients, strict=True)):
            length = len(sample.model_input.tokens)
            if len(gradient.data) != length:
                raise ValueError(
                    f"gradients[{i}].data has {len(gradient.data)} values for a sample of "
                    f"{length} tokens"
                )
        return self


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
    model_inputs: list[ModelInput] = Field(min_length=1)
    num_samples: int = Field(default=1, ge=1, le=1024)
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = Field(default=0, ge=0, le=20)
    return_routed_experts: bool = False


class EmptyBody(Spec):
    """The checkpoint operations take no body."""


def check_samples(
    samples: list[Sample], entry: ModelEntry, required: tuple[str, ...], *, loss_text: str
) -> None:
    """Limits and per-sample consistency (contract Part A §3), as a 400 naming the field."""
    if len(samples) > entry.max_batch_size:
        raise bad_request(
            f"samples: {len(samples)} samples exceed max_batch_size {entry.max_batch_size} "
            f"of {entry.name}",
            "samples",
        )
    total = sum(len(sample.model_input.tokens) for sample in samples)
    if total > entry.max_tokens_per_call:
        raise bad_request(
            f"samples: {total} tokens in all exceed max_tokens_per_call "
            f"{entry.max_tokens_per_call} of {entry.name}; split the call",
            "samples",
        )
    for i, sample in enumerate(samples):
        where = f"samples[{i}]"
        tokens = sample.model_input.tokens
        if not tokens:
            raise bad_request(f"{where}.model_input: no tokens", f"{where}.model_input")
        if len(tokens) > entry.max_seq_length:
            raise bad_request(
                f"{where}.model_input: {len(tokens)} tokens exceed max_seq_length "
                f"{entry.max_seq_length}",
                f"{where}.model_input",
            )
        if min(tokens) < 0:
            raise bad_request(f"{where}.model_input: negative token id", f"{where}.model_input")
        inputs = sample.loss_fn_inputs
        for name in ("target_tokens", *required):
            if name not in inputs:
                raise bad_request(
                    f"{where}.loss_fn_inputs.{name}: required by {loss_text}",
                    f"{where}.loss_fn_inputs.{name}",
                )
        if "weights" in inputs and "mask" in inputs:
            raise bad_request(
                f"{where}.loss_fn_inputs: weights and mask are mutually exclusive",
                f"{where}.loss_fn_inputs",
            )
        for name, tensor in inputs.items():
            field = f"{where}.loss_fn_inputs.{name}"
            known = LOSS_INPUTS.get(name)  # the registry's dtypes
            if known is not None and tensor.dtype not in known.dtypes:
                raise bad_request(f"{field}.dtype must be one of {list(known.dtypes)}", field)
            if len(tensor.data) != len(tokens):
                raise bad_request(
                    f"{field}: {len(tensor.data)} values for {len(tokens)} model_input tokens",
                    field,
                )
        targets = inputs["target_tokens"].data
        if (
            bool((targets < 0).any())  # a packed array (large bodies)
            if isinstance(targets, np.ndarray)
            else any(int(t) < 0 for t in targets)
        ):
            raise bad_request(
                f"{where}.loss_fn_inputs.target_tokens: negative token id",
                f"{where}.loss_fn_inputs.target_tokens",
            )


def check_forward_backward(body: ForwardBackwardBody, entry: ModelEntry) -> None:
    loss = body.loss
    required = loss.spec.required_for(loss.params())  # `LOSS_SPECS`: its inputs and rules
    check_samples(body.samples, entry, required, loss_text=f"loss {loss.type}")


def check_custom(body: CustomForwardBackwardBody, entry: ModelEntry) -> None:
    check_samples(body.samples, entry, (), loss_text="custom-forward-backward")


def check_sample(body: SampleBody, entry: ModelEntry) -> None:
    """Sequence count, `max_tokens` and the call's token total against the model's limits."""
    prompts, n = len(body.model_inputs), body.num_samples
    if prompts * n > entry.max_batch_size:
        field = "num_samples" if n > 1 else "model_inputs"
        raise bad_request(
            f"{field}: {prompts} prompt(s) x {n} sample(s) = {prompts * n} sequences exceed "
            f"max_batch_size {entry.max_batch_size} of {entry.name}",
            field,
        )
    max_tokens = body.sampling_params.max_tokens
    if max_tokens >= entry.max_seq_length:
        raise bad_request(
            f"sampling_params.max_tokens: {max_tokens} must be below the context length "
            f"{entry.max_seq_length} of {entry.name}",
            "sampling_params.max_tokens",
        )
    total = n * sum(len(m.tokens) + max_tokens for m in body.model_inputs)
    if total > entry.max_tokens_per_call:
        raise bad_request(
            f"sampling_params.max_tokens: {prompts} prompt(s) x {n} sample(s) reach {total} "
            f"tokens, over max_tokens_per_call {entry.max_tokens_per_call} of {entry.name}",
            "sampling_params.max_tokens",
        )
    for i, model_input in enumerate(body.model_inputs):
        tokens = model_input.tokens
        if not tokens:
            raise bad_request(f"model_inputs[{i}]: no tokens", f"model_inputs[{i}]")
        if min(tokens) < 0:
            raise bad_request(f"model_inputs[{i}]: negative token id", f"model_inputs[{i}]")
        total = len(tokens) + body.sampling_params.max_tokens
        if total > entry.max_seq_length:
            raise bad_request(
                f"model_inputs[{i}]: {len(tokens)} prompt tokens + max_tokens "
                f"{body.sampling_params.max_tokens} exceed the context length "
                f"{entry.max_seq_length}",
                f"model_inputs[{i}]",
            )


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


def merge_metadata(current: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
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
