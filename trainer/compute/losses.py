"""Built-in RL losses (docs/semantics.md): one pure function per loss, picked from `LOSSES`.

Design notes: `docs/design/compute.md`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from trainer.compute.batch import LossNorm
from trainer.contract.losses import (
    LOSS_INPUTS,
    LOSS_SPECS,
    CispoParams,
    CrossEntropyParams,
    DppoParams,
    DroParams,
    GrpoParams,
    ImportanceSamplingParams,
    PpoParams,
    StableReinforceParams,
)

Metrics = dict[str, tuple[float, float]]


@dataclass(frozen=True)
class LossInputs:
    """A micro-batch's kept positions (`_P`). With soft targets (cross entropy's [T, K]
    `target_tokens`), `logprobs_P` and `weights_P` are `[P, K]`: lp_tk and w_tk."""

    logprobs_P: torch.Tensor  # lp_t, current policy (requires grad in training)
    sample_index_P: torch.Tensor  # int64 in [0, B): which sample of this batch each token is in
    num_samples: int  # B
    mask_P: torch.Tensor  # m_t in {0, 1}
    norm: LossNorm
    weights_P: torch.Tensor | None = None  # w_t (cross entropy only)
    sampler_logprobs_P: torch.Tensor | None = None  # q_t
    advantages_P: torch.Tensor | None = None  # A_t
    reference_logprobs_P: torch.Tensor | None = None  # ref_t


# `loss_fn_inputs` key -> the `LossInputs` field that carries it (the registry's `LossInput.field`)
INPUT_FIELDS = {name: spec.field for name, spec in LOSS_INPUTS.items() if spec.field is not None}


@dataclass
class LossOutputs:
    loss: torch.Tensor  # scalar fp32: this batch's contribution to the call's loss
    metrics: Metrics = field(default_factory=dict)


LossFn = Callable[[LossInputs, Any], LossOutputs]


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _masked(x_P: torch.Tensor, keep_P: torch.Tensor) -> torch.Tensor:
    """x where keep, else exactly 0 (and a zero gradient into x there)."""
    return torch.where(keep_P, x_P, 0.0)


def _given(tensor: torch.Tensor | None, name: str) -> torch.Tensor:
    """An input `pick_loss` has checked against `LOSS_SPECS`, in fp32 (narrows the type)."""
    if tensor is None:
        raise ValueError(f"loss_fn_inputs.{name} is missing")
    return tensor.float()


@torch.no_grad()
def _token_mean(x_P: torch.Tensor, keep_P: torch.Tensor) -> tuple[float, float]:
    return float(_masked(x_P.float(), keep_P).sum()), float(keep_P.sum())


def _per_sample(x_P: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
    """Σ over each sample's tokens: [P] -> [B] (differentiable)."""
    return x_P.new_zeros(inputs.num_samples).index_add(0, inputs.sample_index_P, x_P)


class _RatioTerms(NamedTuple):
    """The per-token terms of the ratio r_t = exp(lp_t - q_t) every policy loss builds on."""

    lp_P: torch.Tensor
    q_P: torch.Tensor
    adv_P: torch.Tensor
    keep_P: torch.Tensor
    log_ratio_P: torch.Tensor  # lp - q at kept tokens, 0 at masked ones (safe to exp)
    ratio_P: torch.Tensor  # r_t; exactly 1 at masked tokens


def _ratio_terms(inputs: LossInputs) -> _RatioTerms:
    lp_P = inputs.logprobs_P.float()
    q_P = _given(inputs.sampler_logprobs_P, "logprobs")
    adv_P = _given(inputs.advantages_P, "advantages")
    keep_P = inputs.mask_P != 0
    log_ratio_P = _masked(lp_P - q_P, keep_P)
    return _RatioTerms(lp_P, q_P, adv_P, keep_P, log_ratio_P, log_ratio_P.exp())


def _ratio_metrics(lp_P: torch.Tensor, ratio_P: torch.Tensor, keep_P: torch.Tensor) -> Metrics:
    return {
        "loss/ratio/mean": _token_mean(ratio_P, keep_P),
        "loss/logprob/mean": _token_mean(lp_P, keep_P),
    }


def _clip_metrics(ratio_P: torch.Tensor, keep_P: torch.Tensor, lo: float, hi: float) -> Metrics:
    with torch.no_grad():
        low_P = (ratio_P < lo).float()
        high_P = (ratio_P > hi).float()
    return {
        "loss/clip/low_fraction": _token_mean(low_P, keep_P),
        "loss/clip/high_fraction": _token_mean(high_P, keep_P),
    }


# --------------------------------------------------------------------------------------------
# Losses
# --------------------------------------------------------------------------------------------


def cross_entropy_loss(inputs: LossInputs, params: CrossEntropyParams) -> LossOutputs:
    """L = Σ_t -w_t · lp_t. Reduction: sum over the batch's tokens with m_t = 1 (m = w≠0).

    Soft targets ([P, K] logprobs and weights): L = Σ_t Σ_k -w_tk · lp_tk, summed over the
    entries with w_tk ≠ 0 (m_t = 1 where any is); `loss/logprob/mean` is the mean lp_tk over
    those entries. With K = 1 both are the [P] case's, bit for bit."""
    w_P = _given(inputs.weights_P, "weights")
    lp_P = inputs.logprobs_P.float()
    keep_P = inputs.mask_P != 0
    if lp_P.ndim == 2:
        keep_P = keep_P[:, None] & (w_P != 0)
    loss = _masked(-w_P * lp_P, keep_P).sum()
    return LossOutputs(loss, {"loss/logprob/mean": _token_mean(lp_P, keep_P)})


def importance_sampling_loss(inputs: LossInputs, params: ImportanceSamplingParams) -> LossOutputs:
    """L = Σ_t -m_t · r_t · A_t, with r_t = exp(clamp(lp_t - q_t, -c, c)) when
    `ratio_log_cap` c is set (no gradient through a clamped ratio). Reduction: sum over masked
    tokens."""
    p = _ratio_terms(inputs)
    cap = params.ratio_log_cap
    ratio_P = p.ratio_P if cap is None else p.log_ratio_P.clamp(-cap, cap).exp()
    loss = _masked(-ratio_P * p.adv_P, p.keep_P).sum()
    return LossOutputs(loss, _ratio_metrics(p.lp_P, ratio_P, p.keep_P))


def ppo_loss(inputs: LossInputs, params: PpoParams) -> LossOutputs:
    """L = Σ_t -m_t · min(r_t·A_t, clip(r_t, lo, hi)·A_t). Reduction: sum over masked tokens."""
    lo, hi = params.clip_low_threshold, params.clip_high_threshold
    p = _ratio_terms(inputs)
    clipped_P = p.ratio_P.clamp(lo, hi)
    objective_P = torch.minimum(p.ratio_P * p.adv_P, clipped_P * p.adv_P)
    loss = _masked(-objective_P, p.keep_P).sum()
    metrics = _ratio_metrics(p.lp_P, p.ratio_P, p.keep_P)
    metrics.update(_clip_metrics(p.ratio_P, p.keep_P, lo, hi))
    return LossOutputs(loss, metrics)


def cispo_loss(inputs: LossInputs, params: CispoParams) -> LossOutputs:
    """L = Σ_t -m_t · sg(clip(r_t, lo, hi)) · A_t · lp_t. Reduction: sum over masked tokens."""
    lo, hi = params.clip_low_threshold, params.clip_high_threshold
    p = _ratio_terms(inputs)
    weight_P = p.ratio_P.clamp(lo, hi).detach()
    loss = _masked(-weight_P * p.adv_P * p.lp_P, p.keep_P).sum()
    metrics = _ratio_metrics(p.lp_P, p.ratio_P, p.keep_P)
    metrics.update(_clip_metrics(p.ratio_P, p.keep_P, lo, hi))
    return LossOutputs(loss, metrics)


def dro_loss(inputs: LossInputs, params: DroParams) -> LossOutputs:
    """L = Σ_t -m_t · (A_t · lp_t - (β/2)·(lp_t - q_t)²). Reduction: sum over masked tokens."""
    p = _ratio_terms(inputs)
    objective_P = p.adv_P * p.lp_P - 0.5 * params.beta * p.log_ratio_P.square()
    loss = _masked(-objective_P, p.keep_P).sum()
    return LossOutputs(loss, _ratio_metrics(p.lp_P, p.ratio_P, p.keep_P))


def dppo_loss(inputs: LossInputs, params: DppoParams) -> LossOutputs:
    """L = Σ_t -m_t · keep_t · r_t · A_t. Reduction: sum over masked tokens.

    keep_t (no gradient) is 1 when A_t ≥ 0 and p_t - p'_t ≤ delta_high, or A_t < 0 and
    p'_t - p_t ≤ delta_low, with p_t = exp(lp_t), p'_t = exp(q_t); both bounds inclusive.
    """
    p = _ratio_terms(inputs)
    with torch.no_grad():
        prob_P, old_prob_P = p.lp_P.exp(), p.q_P.exp()
        in_region_P = torch.where(
            p.adv_P >= 0,
            prob_P - old_prob_P <= params.delta_high,
            old_prob_P - prob_P <= params.delta_low,
        )
    loss = _masked(-p.ratio_P * p.adv_P, p.keep_P & in_region_P).sum()
    metrics = _ratio_metrics(p.lp_P, p.ratio_P, p.keep_P)
    metrics["loss/dppo/masked_fraction"] = _token_mean((~in_region_P).float(), p.keep_P)
    return LossOutputs(loss, metrics)


def _sequence_ratio(p: _RatioTerms, inputs: LossInputs) -> torch.Tensor:
    """GSPO: ρ_t = exp(mean_{t∈m}(sg(lp) - q)) · exp(lp_t - sg(lp_t)); 1 in an all-masked sample."""
    count_B = _per_sample(p.keep_P.float(), inputs)
    mean_B = _per_sample(p.log_ratio_P.detach(), inputs) / count_B.clamp(min=1.0)
    return mean_B[inputs.sample_index_P].exp() * _masked(p.lp_P - p.lp_P.detach(), p.keep_P).exp()


_GRPO_RATIOS: dict[str, Callable[[_RatioTerms, LossInputs], torch.Tensor]] = {
    "GRPO_LOSS_RATIO_TYPE_TOKEN": lambda p, inputs: p.ratio_P,
    "GRPO_LOSS_RATIO_TYPE_SEQUENCE": _sequence_ratio,
}


def _token_mean_agg(loss_P: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
    """Σ m·ℓ / max(1, Σ_call m)."""
    return loss_P.sum() / max(1.0, float(inputs.norm.total_mask))


def _sequence_mean_agg(loss_P: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
    """Σ_samples [Σ_t m·ℓ / max(1, Σ_t m)] / max(1, samples in the call)."""
    count_B = _per_sample((inputs.mask_P != 0).float(), inputs)
    per_sample_B = _per_sample(loss_P, inputs) / count_B.clamp(min=1.0)
    return per_sample_B.sum() / max(1, inputs.norm.total_samples)


def _fixed_horizon_agg(loss_P: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
    """Σ m·ℓ / max(1, samples in the call · H)."""
    return loss_P.sum() / max(1, inputs.norm.total_samples * inputs.norm.horizon)


_GRPO_AGGREGATIONS: dict[str, Callable[[torch.Tensor, LossInputs], torch.Tensor]] = {
    "GRPO_LOSS_AGGREGATION_TYPE_UNSPECIFIED": _token_mean_agg,
    "GRPO_LOSS_AGGREGATION_TYPE_TOKEN_MEAN": _token_mean_agg,
    "GRPO_LOSS_AGGREGATION_TYPE_SEQUENCE_MEAN": _sequence_mean_agg,
    "GRPO_LOSS_AGGREGATION_TYPE_FIXED_HORIZON": _fixed_horizon_agg,
}


def grpo_loss(inputs: LossInputs, params: GrpoParams) -> LossOutputs:
    """ℓ_t = -min(ρ_t·A_t, clip(ρ_t, lo, hi)·A_t) + β·k3_t, k3_t = exp(d_t) - d_t - 1.

    d_t = ref_t - lp_t; ρ_t = r_t (ratio_type TOKEN) or the GSPO sequence ratio (SEQUENCE, see
    `_sequence_ratio`).
    Reduction over the whole call, with denominators from `inputs.norm` only (agg_type):
    TOKEN_MEAN / UNSPECIFIED Σ m·ℓ / max(1, Σ m); SEQUENCE_MEAN mean over the call's samples of
    Σ_t m·ℓ / max(1, Σ_t m); FIXED_HORIZON Σ m·ℓ / (samples · H).
    """
    lo, hi = params.clip_low_threshold, params.clip_high_threshold
    p = _ratio_terms(inputs)
    ratio_P = _GRPO_RATIOS[params.ratio_type](p, inputs)
    loss_P = -torch.minimum(ratio_P * p.adv_P, ratio_P.clamp(lo, hi) * p.adv_P)
    metrics = _ratio_metrics(p.lp_P, ratio_P, p.keep_P)
    metrics.update(_clip_metrics(ratio_P, p.keep_P, lo, hi))
    if inputs.reference_logprobs_P is not None or params.beta > 0:
        ref_diff_P = _masked(
            _given(inputs.reference_logprobs_P, "reference_logprobs") - p.lp_P, p.keep_P
        )
        k3_P = ref_diff_P.exp() - ref_diff_P - 1.0
        metrics["loss/kl_ref/mean"] = _token_mean(k3_P, p.keep_P)
        if params.beta > 0:
            loss_P = loss_P + params.beta * k3_P
    loss = _GRPO_AGGREGATIONS[params.agg_type](_masked(loss_P, p.keep_P), inputs)
    return LossOutputs(loss, metrics)


def stable_reinforce_loss(inputs: LossInputs, params: StableReinforceParams) -> LossOutputs:
    """ℓ_t = -w_t·A_t·lp_t + kl_coeff·(exp(d_t) - d_t - 1), w_t = sg(min(r_t, C)), d_t = q_t - lp_t.

    q_t are the sampler's recorded logprobs and the mask keeps the positions under sampled
    provenance spans (the Tinker face builds both, docs/semantics.md §13). Reduction: sum over
    kept tokens.
    """
    p = _ratio_terms(inputs)
    weight_P = p.ratio_P.clamp(max=params.truncation).detach()
    loss_P = -weight_P * p.adv_P * p.lp_P
    sampler_diff_P = -p.log_ratio_P  # q_t - lp_t at kept tokens, 0 at masked ones
    k3_P = sampler_diff_P.exp() - sampler_diff_P - 1.0
    if params.kl_coeff > 0:
        loss_P = loss_P + params.kl_coeff * k3_P
    loss = _masked(loss_P, p.keep_P).sum()
    metrics = _ratio_metrics(p.lp_P, p.ratio_P, p.keep_P)
    with torch.no_grad():
        truncated_P = (p.ratio_P > params.truncation).float()
    metrics["loss/is_weight/mean"] = _token_mean(weight_P, p.keep_P)
    metrics["loss/truncated_fraction"] = _token_mean(truncated_P, p.keep_P)
    metrics["loss/log_ratio/mean"] = _token_mean(p.log_ratio_P, p.keep_P)
    metrics["loss/kl_sampler/mean"] = _token_mean(k3_P, p.keep_P)
    return LossOutputs(loss, metrics)


def custom_loss(inputs: LossInputs, gradients_P: torch.Tensor) -> LossOutputs:
    """L = Σ_t m_t · g_t · lp_t, so dL/dlp_t = m_t·g_t (custom forward-backward). Sum, no mean."""
    lp_P = inputs.logprobs_P.float()
    keep_P = inputs.mask_P != 0
    loss = _masked(gradients_P.float() * lp_P, keep_P).sum()
    return LossOutputs(loss, {"loss/logprob/mean": _token_mean(lp_P, keep_P)})


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------

LOSSES: dict[str, LossFn] = {
    "LOSS_TYPE_CROSS_ENTROPY": cross_entropy_loss,
    "LOSS_TYPE_IMPORTANCE_SAMPLING": importance_sampling_loss,
    "LOSS_TYPE_PPO": ppo_loss,
    "LOSS_TYPE_CISPO": cispo_loss,
    "LOSS_TYPE_DRO": dro_loss,
    "LOSS_TYPE_DPPO": dppo_loss,
    "LOSS_TYPE_GRPO": grpo_loss,
    "LOSS_TYPE_STABLE_REINFORCE": stable_reinforce_loss,
}


def pick_loss(loss_type: str, params: Any = None) -> Callable[[LossInputs], LossOutputs]:
    """The loss of `loss_type` with its parsed `params` bound (None: that loss's defaults),
    picked once per call. Each micro-batch's inputs are checked against `LOSS_SPECS` first:
    the conditional rules, then the inputs the loss always reads."""
    if loss_type not in LOSSES:
        raise ValueError(f"loss.type {loss_type!r} is not one of {sorted(LOSSES)}")
    spec, fn = LOSS_SPECS[loss_type], LOSSES[loss_type]
    if params is None:
        params = spec.params_cls()
    needed = [(rule.input, rule.reason) for rule in spec.rules_for(params)]
    needed += [(name, f"for {loss_type}") for name in spec.required]

    def compute(inputs: LossInputs) -> LossOutputs:
        for name, reason in needed:
            if getattr(inputs, INPUT_FIELDS[name]) is None:
                raise ValueError(f"loss_fn_inputs.{name} is required {reason}")
        return fn(inputs, params)

    return compute


def compute_loss(loss_type: str, inputs: LossInputs, params: Any = None) -> LossOutputs:
    """One batch through `pick_loss(loss_type, params)`."""
    return pick_loss(loss_type, params)(inputs)
