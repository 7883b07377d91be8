"""The optimizer's settings, in one module: a resource's `optimizer_config` (one optimizer per
resource, AdamW or Muon with its scaling strategy) and the per-step params of each optim-step,
`AdamParams` and `MuonParams` (semantics and defaults: `docs/semantics.md`).

`muon_params.adam` reuses `AdamParams` for the tensors that Muon leaves to its auxiliary AdamW.
The clip is global in a Muon step (`muon_params.grad_clip_norm`): the engine ignores
`adam.grad_clip_norm`, and the request body (`trainer.serving.requests.OptimStepBody`) refuses
one that a client sets.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from trainer.contract.base import Spec

MuonScalingStrategy = Literal[
    "MUON_SCALING_STRATEGY_UNSPECIFIED",
    "MUON_SCALING_STRATEGY_MATCH_ADAM",
    "MUON_SCALING_STRATEGY_ORIGINAL",
]
STRATEGIES: tuple[str, ...] = MuonScalingStrategy.__args__  # type: ignore[attr-defined]

# §10: MATCH_ADAM (also for UNSPECIFIED) is Moonlight's `0.2·√max(out, in)`
ADJUST_LR_FN = {
    "MUON_SCALING_STRATEGY_UNSPECIFIED": "match_rms_adamw",
    "MUON_SCALING_STRATEGY_MATCH_ADAM": "match_rms_adamw",
    "MUON_SCALING_STRATEGY_ORIGINAL": "original",
}
MAX_NEWTON_SCHULZ_STEPS = 99  # torch.optim.Muon refuses 100 or more
# An Adam or Muon step moves each weight by about the learning rate: past 1e2 a step only
# wrecks the weights (or overflows them), so larger rates are refused (docs/decisions.md).
MAX_LEARNING_RATE = 1e2


class AdamParams(Spec):
    """Per-step AdamW knobs; omitted fields take the defaults of docs/semantics.md §14."""

    learning_rate: float = Field(default=1e-4, ge=0.0, le=MAX_LEARNING_RATE, allow_inf_nan=False)
    beta1: float = Field(default=0.9, ge=0.0, lt=1.0)
    beta2: float = Field(default=0.95, ge=0.0, lt=1.0)
    eps: float = Field(default=1e-8, gt=0.0, allow_inf_nan=False)
    weight_decay: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    grad_clip_norm: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)


class MuonParams(Spec):
    """Per-step Muon knobs (§10's defaults); `adam` for the auxiliary AdamW's tensors."""

    learning_rate: float = Field(default=1e-4, ge=0.0, le=MAX_LEARNING_RATE, allow_inf_nan=False)
    momentum: float = Field(default=0.95, ge=0.0, lt=1.0)
    newton_schulz_steps: int = Field(default=5, ge=1, le=MAX_NEWTON_SCHULZ_STEPS)
    weight_decay: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    grad_clip_norm: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)
    adam: AdamParams = Field(default_factory=AdamParams)


def check_optimizer_config(value: Any) -> dict[str, Any]:
    """A resource's `optimizer_config`, normalised: `{"adam": {}}` (also for `{}`, `None` or
    `{"adam": null}`) or `{"muon": {"scaling_strategy": <one of STRATEGIES>}}` (UNSPECIFIED
    when omitted). A ValueError names the offending field."""
    if value is None or value == {}:
        return {"adam": {}}
    if not isinstance(value, dict):
        raise ValueError("optimizer_config must be an object: {'adam': {}} or {'muon': {...}}")
    chosen = [k for k, v in value.items() if v is not None]
    unknown = sorted(set(value) - {"adam", "muon"})
    if unknown:
        names = ", ".join(f"optimizer_config.{k}" for k in unknown)
        raise ValueError(f"unknown field(s) {names}: the optimizers are adam and muon")
    if len(chosen) > 1:
        raise ValueError("optimizer_config: set one of adam and muon, not both")
    if chosen == ["muon"]:
        return {"muon": _muon_config(value["muon"])}
    adam = value.get("adam")
    if adam is None:
        return {"adam": {}}
    if not isinstance(adam, dict):
        raise ValueError("optimizer_config.adam must be an object ({})")
    if adam:
        names = ", ".join(f"optimizer_config.adam.{k}" for k in sorted(adam))
        raise ValueError(
            f"unknown field(s) {names}: the resource's AdamConfig has no fields; per-step "
            "AdamW settings (learning_rate, beta1, beta2, eps, weight_decay, grad_clip_norm) "
            "go in each optim-step's adam_params"
        )
    return {"adam": {}}


def _muon_config(muon: Any) -> dict[str, Any]:
    if not isinstance(muon, dict):
        raise ValueError("optimizer_config.muon must be an object")
    unknown = sorted(set(muon) - {"scaling_strategy"})
    if unknown:
        names = ", ".join(f"optimizer_config.muon.{k}" for k in unknown)
        raise ValueError(
            f"unknown field(s) {names}: MuonConfig has only scaling_strategy; per-step Muon "
            "settings go in each optim-step's muon_params"
        )
    strategy = muon.get("scaling_strategy") or "MUON_SCALING_STRATEGY_UNSPECIFIED"
    if strategy not in STRATEGIES:
        raise ValueError(
            f"optimizer_config.muon.scaling_strategy must be one of {', '.join(STRATEGIES)}"
        )
    return {"scaling_strategy": strategy}


def optimizer_kind(config: dict[str, Any] | None) -> Literal["adam", "muon"]:
    """Which optimizer a (stored, normalised) `optimizer_config` names."""
    return "muon" if config and config.get("muon") is not None else "adam"
