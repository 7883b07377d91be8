"""Typed specs for everything that crosses the edge of the worker.

Every object a client or a config file can send is validated here, once, with a message that
names the field. Names and enum spellings follow the hosted service's wire contract (the
`together` SDK is the authority on shapes; `docs/semantics.md` on semantics). The loss objects
(`LossConfig` and its params, the registry `LOSS_SPECS`) are defined in
`trainer.contract.losses` and the per-step optimizer params in `trainer.contract.optimizer`;
both are importable from here too, as parts of the same request bodies. The checks of a
request's content against a model's limits are `trainer.contract.rules`.

Shape letters used across the package: B = samples in a call, T = tokens of one sample,
N = tokens of a whole (micro-)batch flattened, V = vocabulary, H = hidden size.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from trainer.contract.arrays import ArrayOrList, IntArray, NumArray, as_int64, tensor_values
from trainer.contract.base import Spec as Spec
from trainer.contract.base import StrictSpec as StrictSpec
from trainer.contract.generation import GeneratorOptions
from trainer.contract.losses import LOSS_SPECS as LOSS_SPECS
from trainer.contract.losses import CispoParams as CispoParams
from trainer.contract.losses import CrossEntropyParams as CrossEntropyParams
from trainer.contract.losses import DppoParams as DppoParams
from trainer.contract.losses import DroParams as DroParams
from trainer.contract.losses import GrpoParams as GrpoParams
from trainer.contract.losses import ImportanceSamplingParams as ImportanceSamplingParams
from trainer.contract.losses import InputRule as InputRule
from trainer.contract.losses import LossConfig as LossConfig
from trainer.contract.losses import PpoParams as PpoParams
from trainer.contract.losses import StableReinforceParams as StableReinforceParams
from trainer.contract.optimizer import AdamParams as AdamParams
from trainer.contract.optimizer import check_optimizer_config
from trainer.contract.rules import check_finite
from trainer.contract.values import (
    DEFAULT_MAX_LORA_RANK,
    MAX_LORA_ALPHA,
    MIN_TEMPERATURE,
    PATH_MAX,
    IntLike,
    Seed,
    check_location,
    check_temperature,
)
from trainer.contract.values import int_from_str as _int_from_str

# --------------------------------------------------------------------------------------------
# Tensors and samples
# --------------------------------------------------------------------------------------------


class TensorData(Spec):
    """A 1-D tensor as flat JSON numbers. Token ids may be strings (protobuf int64). `shape`
    may also be `[T, K]` (row-major data): cross entropy's soft targets, which only
    `target_tokens` and `weights` take (`trainer.contract.rules.check_soft_targets`)."""

    # a list, or the int64/float64 array a large body was packed into (`trainer.contract.arrays`)
    data: Annotated[
        list[float | int | str] | NumArray, ArrayOrList(list[float | int | str], "numbers")
    ]
    dtype: Literal["int64", "float32"]
    shape: list[int] | None = None
    sparse_crow_indices: list[int] | None = None
    sparse_col_indices: list[int] | None = None

    @model_validator(mode="after")
    def _check(self) -> TensorData:
        if self.sparse_crow_indices is not None or self.sparse_col_indices is not None:
            raise ValueError("sparse tensors are not supported: omit sparse_crow/col_indices")
        if self.shape is not None and self.shape != [len(self.data)]:
            two_d = len(self.shape) == 2 and min(self.shape) >= 0
            if not two_d or self.shape[0] * self.shape[1] != len(self.data):
                raise ValueError(
                    f"shape must be [len(data)] = [{len(self.data)}], or [T, K] with "
                    f"T·K = len(data) (soft targets), got {self.shape}"
                )
        if isinstance(self.data, np.ndarray):
            values = tensor_values(self.data, self.dtype)
            if self.dtype == "float32":
                check_finite(values, "data")
            self.data = values
        elif self.dtype == "int64":
            self.data = [_token_id(i, value) for i, value in enumerate(self.data)]
        else:
            floats: list[float | int | str] = [_float_value(i, v) for i, v in enumerate(self.data)]
            check_finite(np.asarray(floats, dtype=np.float64), "data")
            self.data = floats
        return self


def _float_value(i: int, value: float | int | str) -> float:
    """One float32 value of a listed `TensorData`: a JSON number, never a string."""
    if isinstance(value, str):
        raise ValueError(f"data[{i}] = {value[:40]!r} is a string; float32 values are numbers")
    return float(value)


def _token_id(i: int, value: float | int | str) -> int | str:
    """One int64 value of a listed `TensorData`: an integral float or an integer string."""
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"data[{i}] = {value} is not an integer (dtype int64)")
        value = int(value)
    return _int_from_str(value)  # type: ignore[no-any-return]


class EncodedTextChunk(Spec):
    tokens: Annotated[list[IntLike] | IntArray, ArrayOrList(list[IntLike], "ints")]


class ModelInputChunk(Spec):
    encoded_text: EncodedTextChunk | None = None

    @model_validator(mode="after")
    def _check(self) -> ModelInputChunk:
        if self.encoded_text is None:
            raise ValueError("only encoded_text chunks are supported")
        return self


class ModelInput(Spec):
    chunks: list[ModelInputChunk]

    @property
    def tokens(self) -> list[int]:
        out: list[int] = []
        for chunk in self.chunks:
            assert chunk.encoded_text is not None
            tokens = chunk.encoded_text.tokens
            out.extend(tokens.tolist() if isinstance(tokens, np.ndarray) else tokens)
        return out

    def token_array(self) -> IntArray:
        """The tokens as one int64 array, without a Python int per token for packed chunks
        (OverflowError for a listed int past int64)."""
        parts = [as_int64(chunk.encoded_text.tokens) for chunk in self.chunks if chunk.encoded_text]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def chunk_lengths(self) -> list[int]:
        """How many tokens each chunk holds, in order."""
        return [
            len(chunk.encoded_text.tokens) if chunk.encoded_text else 0 for chunk in self.chunks
        ]


class Sample(Spec):
    model_input: ModelInput
    loss_fn_inputs: dict[str, TensorData] = Field(default_factory=dict)
    routed_experts_key: str | None = None
    # the routes themselves instead of a key: one base64 matrix per model-input position, ""
    # for the router's own choice (`trainer.contract.routing`; docs/semantics.md §12)
    routing_matrices: list[str] | None = None


class Gradient(Spec):
    data: Annotated[list[float] | NumArray, ArrayOrList(list[float], "floats")]
    dtype: Literal["D_TYPE_UNSPECIFIED", "D_TYPE_FLOAT32", "D_TYPE_BFLOAT16"] = "D_TYPE_FLOAT32"

    @field_validator("data")
    @classmethod
    def _finite(cls, value: list[float] | NumArray) -> list[float] | NumArray:
        check_finite(value, "data")
        return value


# --------------------------------------------------------------------------------------------
# LoRA, sampling
# --------------------------------------------------------------------------------------------


class LoraConfig(Spec):
    rank: int = Field(default=32, ge=1)
    alpha: int = Field(
        default=64, ge=1, le=MAX_LORA_ALPHA, description="LoRA scale numerator (alpha/rank)"
    )
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    seed: Seed | None = None
    train_unembed: bool = True
    # PEFT's Kaiming-uniform A (zero B), or NoRA: that A with each input column scaled to unit
    # L2 norm over the rank (docs/semantics.md §23); left out of dumps when it is the default
    init_method: Literal["kaiming", "nora"] = Field(
        default="kaiming", exclude_if=lambda method: method == "kaiming"
    )


# Why a sampled sequence ended: EOS or a stop (STOP), `max_tokens` (LENGTH), or its caller's
# watch said stop (CANCELLED: a completions client that left; `trainer/compute/sampler.py`).
STOP_LENGTH = "STOP_REASON_LENGTH"
STOP_STOP = "STOP_REASON_STOP"
STOP_CANCELLED = "STOP_REASON_CANCELLED"


class SamplingParams(Spec):
    max_tokens: int = Field(default=100, ge=1)
    temperature: Annotated[float, AfterValidator(check_temperature)] = Field(
        default=1.0,
        ge=0.0,
        allow_inf_nan=False,
        description=f"0 samples greedily; otherwise at least {MIN_TEMPERATURE}",
    )
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    stop: list[str] = Field(default_factory=list)
    # token ids that end a sequence like EOS does (the Tinker face's integer `stop`)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    seed: Seed | None = None
    top_logprobs: int = Field(
        default=0,
        ge=0,
        le=20,
        description="per generated token, the model's k most likely ids and their logprobs "
        "(raw logits: no temperature, top-k or top-p); 0: none",
    )


# --------------------------------------------------------------------------------------------
# Resources, sessions, catalogue
# --------------------------------------------------------------------------------------------


CHUNK_DATUMS = 1024
"""The datums one Tinker forward / forward-backward call may carry whatever the model's
`max_batch_size` (the Fireworks SDK sends chunks of up to 1,024): memory is bounded by
`max_tokens_per_call` and `max_seq_length`, which still hold."""


def chunk_datums(max_batch_size: int) -> int:
    """The sample cap of a Tinker forward(-backward) call on a model of `max_batch_size`."""
    return max(max_batch_size, CHUNK_DATUMS)


class ModelEntry(StrictSpec):
    """One base model the worker can serve, with its limits."""

    name: str = Field(min_length=1, description="name clients use as base_model")
    location: str = Field(min_length=1, description="local dir, hub id, or hf://org/name")
    revision: str | None = None
    tokenizer: str | None = Field(
        default=None, description="tokenizer dir or hub id (default: location)"
    )
    max_seq_length: int = Field(default=4096, ge=2, description="tokens per sample")
    max_lora_rank: int = Field(
        default=DEFAULT_MAX_LORA_RANK, ge=1, description="largest LoRA rank a session may train"
    )
    max_batch_size: int = Field(default=256, ge=1, description="samples per call")
    max_tokens_per_call: int = Field(
        default=1 << 20,
        ge=1,
        description="tokens in one call: all samples of a forward-backward, or prompts plus "
        "max_tokens for every sequence of a sample call",
    )
    trust_remote_code: bool = False
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    attn_implementation: str | None = Field(
        default=None,
        description="the attention transformers computes with (eager, sdpa, flash_attention_2, "
        "flex_attention, ...); default: the fastest the model supports exactly",
    )
    generator: GeneratorOptions | None = Field(
        default=None, description="this model's own `[generator]` keys (over the worker's)"
    )


class ComputeConfig(Spec):
    gpu_type: str | None = None
    num_generator_replicas: int = Field(default=1, ge=0)


class ResourceSpec(Spec):
    base_model: str = Field(min_length=1)
    base_weights_ref: str | None = None
    lora_enabled: bool = True
    optimizer_config: dict[str, Any] = Field(default_factory=lambda: {"adam": {}})
    compute_config: ComputeConfig = Field(default_factory=ComputeConfig)
    inactive_timeout: int = Field(default=3600, ge=300, le=86400)

    @field_validator("optimizer_config", mode="before")
    @classmethod
    def _one_optimizer(cls, value: Any) -> dict[str, Any]:
        return check_optimizer_config(value)


_NAME = Field(default=None, max_length=256)


class WandbMetadata(Spec):
    """The SDK's `WandbMetadata`: these six strings and no others ("" clears one in a PATCH)."""

    model_config = ConfigDict(extra="forbid")

    entity: str | None = _NAME
    project: str | None = _NAME
    group: str | None = _NAME
    run_id: str | None = _NAME
    run_name: str | None = _NAME
    url: str | None = Field(default=None, max_length=2048, description="http(s) URL of the run")

    @field_validator("entity", "project", "group", "run_id", "run_name", "url")
    @classmethod
    def _printable(cls, value: str | None) -> str | None:
        if value is not None and not value.isprintable():
            raise ValueError("control characters are not allowed")
        return value

    @field_validator("url")
    @classmethod
    def _http(cls, value: str | None) -> str | None:
        if value and not value.startswith(("https://", "http://")):
            raise ValueError('must be an http(s) URL (or "" to clear it)')
        return value


class SessionMetadata(Spec):
    """The SDK's `SessionMetadata`: only `wandb` exists; an unknown key is refused."""

    model_config = ConfigDict(extra="forbid")

    wandb: WandbMetadata | None = None


class SessionSpec(Spec):
    lora_config: LoraConfig | None = None
    resume_from_checkpoint_id: str | None = None
    resume_from_hf_checkpoint: Annotated[str | None, AfterValidator(check_location)] = Field(
        default=None,
        max_length=PATH_MAX,
        description="hub id (org/name, hf://org/name) or a local directory the worker may read",
    )
    load_optimizer: bool | None = None
    display_name: str | None = Field(default=None, max_length=128)
    metadata: SessionMetadata = Field(default_factory=SessionMetadata)

    @model_validator(mode="after")
    def _check(self) -> SessionSpec:
        if self.resume_from_checkpoint_id and self.resume_from_hf_checkpoint:
            raise ValueError(
                "resume_from_checkpoint_id and resume_from_hf_checkpoint are mutually exclusive"
            )
        if self.resume_from_hf_checkpoint and self.load_optimizer:
            raise ValueError(
                "load_optimizer must be false or omitted with resume_from_hf_checkpoint "
                "(a HF checkpoint carries no optimizer state)"
            )
        return self
