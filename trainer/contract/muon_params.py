"""Muon's per-step `muon_params` (Part B rule 10); the resource's `optimizer_config` is
`trainer.contract.optimizer`.

`AdamParams` (rule 7) lives in `trainer.contract.specs`; `muon_params.adam` reuses it for the
tensors
that Muon leaves to its auxiliary AdamW. The clip is global in a Muon step
(`muon_params.grad_clip_norm`): the engine ignores `adam.grad_clip_norm`, and the request
body (`trainer.serving.requests.OptimStepBody`) refuses one that a client sets.
"""

from __future__ import annotations

from pydantic import Field

from trainer.contract.optimizer import MAX_NEWTON_SCHULZ_STEPS
from trainer.contract.specs import AdamParams, Spec


class MuonParams(Spec):
    """Per-step Muon knobs (rule 10's defaults); `adam` for the auxiliary AdamW's tensors."""

    learning_rate: float = Field(default=1e-4, ge=0.0, allow_inf_nan=False)
    momentum: float = Field(default=0.95, ge=0.0, lt=1.0)
    newton_schulz_steps: int = Field(default=5, ge=1, le=MAX_NEWTON_SCHULZ_STEPS)
    weight_decay: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    grad_clip_norm: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)
    adam: AdamParams = Field(default_factory=AdamParams)
