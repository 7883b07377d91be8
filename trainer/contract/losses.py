"""The loss registry: every built-in loss and every input a loss reads, stated once.

`LOSS_SPECS` holds, per wire `LOSS_TYPE_*` (its short name is the rest in lower case: `ppo`),
the loss's params object on the wire (`<x>_params`) and its class with the defaults and bounds,
the `loss_fn_inputs` it requires, those it reads when given, whether `weights` are a mask,
whether it takes [T, K] soft targets, and the inputs it needs only with some params
(`InputRule`). `LOSS_INPUTS` holds, per input, the
dtypes it may be sent in and the `LossInputs` field a loss function reads it from.

Everything else is derived from these two tables: the checks of `trainer.contract.rules` (the
HTTP edge's 400, the engine's INVALID_INPUT, the Tinker face's refusals), the loss functions of
`trainer.compute.losses` (one per entry) and the inputs the Tinker face accepts. So a new loss is
one entry here and one function there. Formulas and reductions: `docs/semantics.md`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from trainer.contract.base import Spec

LossType = Literal[
    "LOSS_TYPE_UNSPECIFIED",
    "LOSS_TYPE_CROSS_ENTROPY",
    "LOSS_TYPE_GRPO",
    "LOSS_TYPE_IMPORTANCE_SAMPLING",
    "LOSS_TYPE_PPO",
    "LOSS_TYPE_CISPO",
    "LOSS_TYPE_DRO",
    "LOSS_TYPE_DPPO",
    "LOSS_TYPE_STABLE_REINFORCE",
]
GrpoAggType = Literal[
    "GRPO_LOSS_AGGREGATION_TYPE_UNSPECIFIED",
    "GRPO_LOSS_AGGREGATION_TYPE_FIXED_HORIZON",
    "GRPO_LOSS_AGGREGATION_TYPE_TOKEN_MEAN",
    "GRPO_LOSS_AGGREGATION_TYPE_SEQUENCE_MEAN",
]
GrpoRatioType = Literal["GRPO_LOSS_RATIO_TYPE_TOKEN", "GRPO_LOSS_RATIO_TYPE_SEQUENCE"]


# --------------------------------------------------------------------------------------------
# Params
# --------------------------------------------------------------------------------------------


class _ClipParams(Spec):
    """The ratio clip of PPO, CISPO and GRPO; each bound is checked on its own field, so a
    refusal names it (`loss.ppo_params` on the RL face, `loss_fn_config` on the Tinker face)."""

    clip_low_threshold: float
    clip_high_threshold: float

    @field_validator("clip_low_threshold")
    @classmethod
    def _low(cls, value: float) -> float:
        if not 0.0 <= value <= 1.0:
            raise ValueError("must be in [0, 1]")
        return value

    @field_validator("clip_high_threshold")
    @classmethod
    def _high(cls, value: float) -> float:
        if not 1.0 <= value < math.inf:
            raise ValueError("must be >= 1 and finite")
        return value


class CrossEntropyParams(Spec):
    """No knobs. L = sum_t -w_t * lp_t; with [T, K] soft targets sum_t sum_k -w_tk * lp_tk."""


class ImportanceSamplingParams(Spec):
    """L = sum_t -m_t * r_t * A_t. `ratio_log_cap` (unset: none) clamps log r_t to
    [-cap, cap] before the exponential, as Tinker's server-side loss takes it."""

    ratio_log_cap: float | None = Field(default=None, ge=0.0, allow_inf_nan=False)


class PpoParams(_ClipParams):
    clip_low_threshold: float = 0.8
    clip_high_threshold: float = 1.2


class CispoParams(_ClipParams):
    clip_low_threshold: float = 0.0
    clip_high_threshold: float = 5.0


class GrpoParams(_ClipParams):
    clip_low_threshold: float = 0.8
    clip_high_threshold: float = 1.28
    beta: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    agg_type: GrpoAggType = "GRPO_LOSS_AGGREGATION_TYPE_TOKEN_MEAN"
    ratio_type: GrpoRatioType = "GRPO_LOSS_RATIO_TYPE_TOKEN"


class DppoParams(Spec):
    delta_low: float = Field(default=0.15, ge=0.0, le=1.0)
    delta_high: float = Field(default=0.15, ge=0.0, le=1.0)


class DroParams(Spec):
    beta: float = Field(ge=0.0, allow_inf_nan=False)


class StableReinforceParams(Spec):
    """The Tinker face's `stable_reinforce` (docs/semantics.md §13): w_t = sg(min(r_t, C)),
    ℓ_t = -w_t·A_t·lp_t + kl_coeff·k3(q_t - lp_t). Its `logprobs` are the sampler's recorded
    ones, which only the Tinker face holds."""

    kl_coeff: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    truncation: float = Field(default=2.0, gt=0.0, allow_inf_nan=False)


LossParams = (
    CrossEntropyParams
    | ImportanceSamplingParams
    | PpoParams
    | CispoParams
    | DroParams
    | DppoParams
    | GrpoParams
    | StableReinforceParams
)
"""The typed union a `LossConfig`'s `<x>_params` is parsed into, once, at the edge."""


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LossInput:
    """One `loss_fn_inputs` key: the `TensorData` dtypes it may be sent in, and where it goes."""

    dtypes: tuple[str, ...]
    field: str | None = None  # the `LossInputs` field that carries it; None: the batch reads it
    token_ids: bool = False  # int64 ids in [0, vocab); every other input is per-token floats


LOSS_INPUTS: dict[str, LossInput] = {
    "target_tokens": LossInput(("int64",), token_ids=True),
    "logprobs": LossInput(("float32",), "sampler_logprobs_P"),
    "advantages": LossInput(("float32",), "advantages_P"),
    "reference_logprobs": LossInput(("float32",), "reference_logprobs_P"),
    "weights": LossInput(("int64", "float32"), "weights_P"),
    "mask": LossInput(("int64", "float32")),
}
"""Every input a loss can read. Each sample carries `target_tokens`; `mask` (m_t = mask != 0)
or `weights` (not both) mask its tokens, for every loss."""

SOFT_INPUTS = ("target_tokens", "weights")
"""The inputs that may be [T, K] for a loss with `soft_targets` (both, of the same shape)."""
MAX_TARGET_COLUMNS = 128
"""K of [T, K] soft targets: at most this many weighted targets per position."""

TOKEN_INPUTS = tuple(name for name, spec in LOSS_INPUTS.items() if spec.token_ids)
FLOAT_INPUTS = tuple(name for name, spec in LOSS_INPUTS.items() if not spec.token_ids)


@dataclass(frozen=True)
class InputRule:
    """A `loss_fn_inputs` entry a loss needs only with some parameter values."""

    input: str  # the loss_fn_inputs key
    reason: str  # completes "... is required <reason>"
    applies: Callable[[Any], bool]  # of the loss's parsed params


@dataclass(frozen=True)
class LossSpec:
    """What one loss needs, stated once: its params on the wire and the inputs it reads.

    Every check (the API's 400, the engine's INVALID_INPUT, `losses.compute_loss`) reads this.
    """

    params_key: str  # `<x>_params` on the wire
    params_cls: type[Spec]
    required: tuple[str, ...]  # loss_fn_inputs every sample must carry
    weights_are_mask: bool = True  # False: fractional `weights` scale the tokens (CE)
    rules: tuple[InputRule, ...] = ()
    optional: tuple[str, ...] = ()  # inputs it reads when given, besides `mask` / `weights`
    rl_face: bool = True  # False: the Tinker face alone builds its inputs (a 400 on the RL face)
    # inputs the Tinker face builds from its records (a datum may send them; they are replaced)
    built: tuple[str, ...] = ()
    # `target_tokens` and `weights` may be [T, K]: K weighted targets per position (the soft
    # targets of top-K distillation); every other input stays [T]
    soft_targets: bool = False

    def rules_for(self, params: Any) -> tuple[InputRule, ...]:
        """The conditional inputs that these params make required."""
        return tuple(rule for rule in self.rules if rule.applies(params))

    def required_for(self, params: Any) -> tuple[str, ...]:
        """Every input these params make required: `required`, then the rules that apply."""
        return self.required + tuple(rule.input for rule in self.rules_for(params))


_POLICY_INPUTS = ("logprobs", "advantages")
LOSS_SPECS: dict[str, LossSpec] = {
    "LOSS_TYPE_CROSS_ENTROPY": LossSpec(
        "cross_entropy_params",
        CrossEntropyParams,
        ("weights",),
        weights_are_mask=False,
        soft_targets=True,
    ),
    "LOSS_TYPE_IMPORTANCE_SAMPLING": LossSpec(
        "importance_sampling_params", ImportanceSamplingParams, _POLICY_INPUTS
    ),
    "LOSS_TYPE_PPO": LossSpec("ppo_params", PpoParams, _POLICY_INPUTS),
    "LOSS_TYPE_CISPO": LossSpec("cispo_params", CispoParams, _POLICY_INPUTS),
    "LOSS_TYPE_DRO": LossSpec("dro_params", DroParams, _POLICY_INPUTS),
    "LOSS_TYPE_DPPO": LossSpec("dppo_params", DppoParams, _POLICY_INPUTS),
    "LOSS_TYPE_GRPO": LossSpec(
        "grpo_params",
        GrpoParams,
        _POLICY_INPUTS,
        rules=(InputRule("reference_logprobs", "when grpo_params.beta > 0", lambda p: p.beta > 0),),
        optional=("reference_logprobs",),  # its KL metric, whenever given
    ),
    # `logprobs` are the records' (the Tinker face resolves the datums' provenance spans)
    "LOSS_TYPE_STABLE_REINFORCE": LossSpec(
        "stable_reinforce_params",
        StableReinforceParams,
        _POLICY_INPUTS,
        rl_face=False,
        built=("logprobs", "mask"),
    ),
}
_SHORT_LOSS_NAMES = {key.removeprefix("LOSS_TYPE_").lower(): key for key in LOSS_SPECS}


class LossConfig(Spec):
    """`{"type": ..., "<x>_params": {...}}`. Only the params object matching `type` is read:
    validation parses it once into `params()` (one of `LossParams`)."""

    type: LossType
    cross_entropy_params: dict[str, Any] | None = None
    importance_sampling_params: dict[str, Any] | None = None
    grpo_params: dict[str, Any] | None = None
    ppo_params: dict[str, Any] | None = None
    cispo_params: dict[str, Any] | None = None
    dppo_params: dict[str, Any] | None = None
    dro_params: dict[str, Any] | None = None
    stable_reinforce_params: dict[str, Any] | None = None
    _params: Any = PrivateAttr(default=None)

    @field_validator("type", mode="before")
    @classmethod
    def _short_names(cls, value: Any) -> Any:
        if isinstance(value, str) and value.lower() in _SHORT_LOSS_NAMES:
            return _SHORT_LOSS_NAMES[value.lower()]
        return value

    @model_validator(mode="after")
    def _check(self) -> LossConfig:
        if self.type not in LOSS_SPECS:  # LOSS_TYPE_UNSPECIFIED
            raise ValueError("loss.type must name a loss (LOSS_TYPE_UNSPECIFIED is not one)")
        self._params = self._parse()  # now, so the error names the field
        return self

    def _parse(self) -> Any:
        spec = self.spec
        raw = getattr(self, spec.params_key, None) or {}
        for name, info in spec.params_cls.model_fields.items():
            if info.is_required() and raw.get(name) is None:
                raise ValueError(f"loss.{spec.params_key}.{name} is required for {self.type}")
        try:
            return spec.params_cls.model_validate(raw)
        except Exception as exc:  # re-raise with the field path
            raise ValueError(f"loss.{spec.params_key}: {exc}") from None

    @property
    def spec(self) -> LossSpec:
        return LOSS_SPECS[self.type]

    def params(self) -> LossParams:
        """The parsed params of `type` (parsed at validation, not again)."""
        if self._params is None:  # built without validation (`model_construct`)
            self._params = self._parse()
        return self._params  # type: ignore[no-any-return]
