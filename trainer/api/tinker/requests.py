"""The Tinker SDK's JSON request bodies (tinker 0.38 `types/`, and the Fireworks SDK's 0.23 with its
extras), validated once at the edge.

Unknown fields are ignored, as newer SDKs may send more. Each model keeps the SDK's field
names, so a 400 names the field the SDK user set. Tensor-heavy bodies (forward-backward,
optim params, sampling) are validated by `trainer.api.tinker.convert` on their way to the
engine's own bodies.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, ConfigDict, Field, field_validator, model_validator

from trainer.checkpoint.export import MAX_RECIPIENTS, recipient
from trainer.contract.specs import Spec

NAME_MAX = 256


class CreateSession(Spec):
    tags: list[str] = Field(default_factory=list, max_length=64)
    user_metadata: dict[str, Any] | None = None
    sdk_version: str = Field(default="", max_length=64)
    project_id: str | None = Field(default=None, max_length=NAME_MAX)
    display_name: str | None = Field(default=None, max_length=NAME_MAX)


class SessionRef(Spec):
    session_id: str = Field(min_length=1, max_length=NAME_MAX)


class TinkerLoraConfig(Spec):
    rank: int = Field(ge=0)  # 0: full weights (the Fireworks SDK's `lora_rank=0`)
    alpha: int | None = Field(default=None, ge=1)  # None: Tinker's 32 (`routes.LORA_ALPHA`)
    # PEFT's Kaiming-uniform A, zero B; or NoRA (docs/semantics.md §23)
    init_method: Literal["kaiming", "nora"] | None = None
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True

    @model_validator(mode="after")
    def _all_blocks(self) -> TinkerLoraConfig:
        for name in ("train_mlp", "train_attn"):
            if not getattr(self, name):
                raise ValueError(
                    f"{name}: false is not served here (LoRA covers the attention and MLP "
                    "projections of every layer)"
                )
        return self


class OptimizerConfig(Spec):
    type: str = "adamw"

    @model_validator(mode="after")
    def _adam(self) -> OptimizerConfig:
        if self.type != "adamw":
            raise ValueError(
                f"type: optimizer {self.type!r} is not served through the Tinker API; use "
                "'adamw' (Muon is served through the RL session API's optimizer_config)"
            )
        return self


class CreateModel(Spec):
    session_id: str = Field(min_length=1, max_length=NAME_MAX)
    model_seq_id: int = Field(ge=0)
    base_model: str = Field(min_length=1, max_length=NAME_MAX)
    user_metadata: dict[str, Any] | None = None
    lora_config: TinkerLoraConfig | None = None
    optimizer_config: OptimizerConfig = Field(default_factory=OptimizerConfig)
    # the Fireworks SDK's frozen reference on the same trainer: the base model, forward only
    base_only: bool = False
    projection_head_dim: None = Field(
        default=None, description="a train-only projection head: not served (omit it)"
    )

    @model_validator(mode="after")
    def _base_only(self) -> CreateModel:
        if self.base_only and self.lora_config is not None:
            raise ValueError("lora_config: a base_only model has none (it is the base model)")
        return self


class ModelRef(Spec):
    model_id: str = Field(min_length=1, max_length=NAME_MAX)


class SaveWeights(Spec):
    model_id: str = Field(min_length=1, max_length=NAME_MAX)
    path: str | None = Field(default=None, max_length=NAME_MAX)
    seq_id: int | None = None
    ttl_seconds: int | None = Field(default=None, ge=1)
    overwrite: bool = False
    user_metadata: dict[str, str] | None = None


QuestionType = Literal["noul", "choice", "score"]
Label = Annotated[str, Field(min_length=1, max_length=64)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
METRIC_GROUPS, METRICS_PER_GROUP = 16, 32


class DecisionCalibration(Spec):
    """Held-out decision temperatures per question type (the Fireworks SDK's
    `metadata.decision_calibration`), written as the checkpoint's `decision.json`."""

    model_config = ConfigDict(extra="forbid", strict=True)

    contract: str = Field(default="systemone-letter-v1", pattern=r"^[a-z0-9][a-z0-9._-]{0,63}$")
    objective: Literal["nll"] = "nll"
    temperature: dict[QuestionType, Annotated[float, Field(gt=0.0, le=100.0)]]
    fit_rows: dict[QuestionType, Annotated[int, Field(ge=0)]] = Field(default_factory=dict)
    metrics: dict[Label, dict[Label, Finite]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _bounded(self) -> DecisionCalibration:
        if len(self.metrics) > METRIC_GROUPS or any(
            len(group) > METRICS_PER_GROUP for group in self.metrics.values()
        ):
            raise ValueError(
                f"metrics: at most {METRIC_GROUPS} groups of {METRICS_PER_GROUP} values"
            )
        return self


class SamplerMetadata(Spec):
    model_config = ConfigDict(extra="forbid", strict=True)

    decision_calibration: DecisionCalibration | None = None


class SaveWeightsForSampler(Spec):
    model_id: str = Field(min_length=1, max_length=NAME_MAX)
    path: str | None = Field(default=None, max_length=NAME_MAX)
    sampling_session_seq_id: int | None = None
    kind: str = "snapshot"
    seq_id: int | None = None
    ttl_seconds: int | None = Field(default=None, ge=1)
    user_metadata: dict[str, str] | None = None
    # the Fireworks SDK's extras (docs/semantics.md §23): every type is written whole, as
    # the worker's inference checkpoint (the PEFT adapter of a LoRA model, and the merged
    # model: `merged_base`'s export); `delta` is stored whole too
    checkpoint_type: Literal["base", "delta", "merged_base"] | None = None
    export_precision: str | None = Field(default=None, max_length=64)  # `merged_base` only
    metadata: SamplerMetadata | None = None


class LoadWeights(Spec):
    model_id: str | None = Field(default=None, max_length=NAME_MAX)
    seq_id: int | None = None
    session_id: str | None = Field(default=None, max_length=NAME_MAX)
    model_seq_id: int | None = Field(default=None, ge=0)
    base_model: str | None = Field(default=None, max_length=NAME_MAX)
    user_metadata: dict[str, Any] | None = None
    path: str = Field(min_length=1, max_length=4096)
    optimizer: bool = False
    optimizer_config: OptimizerConfig | None = None

    @model_validator(mode="after")
    def _addressed(self) -> LoadWeights:
        if self.model_id is None and (self.session_id is None or self.model_seq_id is None):
            raise ValueError("model_id: set model_id, or session_id with model_seq_id")
        if self.model_id is not None and self.session_id is not None:
            raise ValueError("session_id: mutually exclusive with model_id")
        return self


class CreateSamplingSession(Spec):
    session_id: str = Field(min_length=1, max_length=NAME_MAX)
    sampling_session_seq_id: int = Field(ge=0)
    base_model: str | None = Field(default=None, max_length=NAME_MAX)
    model_path: str | None = Field(default=None, max_length=4096)

    @model_validator(mode="after")
    def _target(self) -> CreateSamplingSession:
        if self.base_model is None and self.model_path is None:
            raise ValueError("base_model: set base_model or model_path")
        return self


class RetrieveFuture(Spec):
    request_id: str = Field(min_length=1, max_length=NAME_MAX)
    allow_metadata_only: bool = False


class WeightsInfo(Spec):
    tinker_path: str = Field(min_length=1, max_length=4096)


class CheckpointTtl(Spec):
    ttl_seconds: int | None = Field(default=None, ge=1)  # None: the checkpoint never expires


def _age_recipient(text: str) -> str:
    recipient(text)  # ValueError: not one (the message never repeats the text)
    return text


AgeRecipient = Annotated[str, Field(max_length=16384), AfterValidator(_age_recipient)]


class SaveWeightsExternal(Spec):
    model_id: str = Field(min_length=1, max_length=NAME_MAX)
    path: str = Field(min_length=1, max_length=NAME_MAX)
    seq_id: int | None = None
    ttl_seconds: int | None = Field(default=None, ge=1)
    age_encryption_recipients: list[AgeRecipient] | None = Field(
        default=None, max_length=MAX_RECIPIENTS
    )

    @field_validator("age_encryption_recipients")
    @classmethod
    def _some(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not value:
            raise ValueError(
                "an empty list encrypts to no one: omit the field for plain files, or name "
                "at least one recipient"
            )
        return value
