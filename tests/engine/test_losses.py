"""Built-in losses against an independent, naive reference of docs/semantics.md §1-§5.

The reference below never calls `trainer.compute.losses`: it walks per-sample Python lists token by
token, skips masked tokens with `if`, and builds the loss from scalar float64 torch ops so that
autograd gives the reference gradient w.r.t. every logprob.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from trainer.compute.batch import LossNorm
from trainer.compute.losses import (
    LOSSES,
    LossInputs,
    LossOutputs,
    compute_loss,
    custom_loss,
)
from trainer.contract.specs import (
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

F64 = torch.float64
LENGTHS = (5, 1, 8, 3, 6, 4, 7)
ALL_MASKED = 2  # index of a sample whose tokens are all masked
SPLITS = ([[0, 1], [2, 3, 4], [5, 6]], [[i] for i in range(len(LENGTHS))])
AGGS = ("TOKEN_MEAN", "SEQUENCE_MEAN", "FIXED_HORIZON", "UNSPECIFIED")

Sample = dict[str, list[float]]


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


def make_samples(seed: int = 0, cross_entropy: bool = False) -> list[Sample]:
    """Samples of different lengths, random masks, one all-masked sample, mixed-sign advantages,
    sampler logprobs within ±0.6 nats of lp so ratios cross both clip bounds."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i, n in enumerate(LENGTHS):
        lp = -(torch.rand(n, generator=g) * 2.5 + 0.05)
        q = (lp + (torch.rand(n, generator=g) - 0.5) * 1.2).clamp(max=-0.01)
        adv = (torch.rand(n, generator=g) - 0.5) * 4
        ref = lp + (torch.rand(n, generator=g) - 0.5) * 0.6
        w = torch.tensor([0.0, 0.5, 1.0, 2.0])[torch.randint(0, 4, (n,), generator=g)]
        m = (w != 0).float() if cross_entropy else (torch.rand(n, generator=g) < 0.75).float()
        if i == ALL_MASKED:
            m.zero_()
            w.zero_()
        sample = {"lp": lp, "q": q, "A": adv, "ref": ref, "m": m, "w": w}
        samples.append({key: value.tolist() for key, value in sample.items()})
    return samples


def norm_of(samples: list[Sample]) -> LossNorm:
    return LossNorm(
        total_mask=float(sum(sum(s["m"]) for s in samples)),
        total_samples=len(samples),
        horizon=max(len(s["lp"]) for s in samples),
    )


def build(
    samples: list[Sample], norm: LossNorm, dtype: torch.dtype = torch.float32
) -> tuple[LossInputs, torch.Tensor]:
    def cat(key: str) -> torch.Tensor:
        return torch.tensor([x for s in samples for x in s[key]], dtype=dtype)

    lp_P = cat("lp").requires_grad_(True)
    index_P = torch.tensor([i for i, s in enumerate(samples) for _ in s["lp"]], dtype=torch.int64)
    inputs = LossInputs(
        logprobs_P=lp_P,
        sample_index_P=index_P,
        num_samples=len(samples),
        mask_P=cat("m"),
        norm=norm,
        weights_P=cat("w"),
        sampler_logprobs_P=cat("q"),
        advantages_P=cat("A"),
        reference_logprobs_P=cat("ref"),
    )
    return inputs, lp_P


def run(loss_type: str, samples: list[Sample], params: Any, norm: LossNorm | None = None):
    inputs, lp_P = build(samples, norm or norm_of(samples))
    out = compute_loss(loss_type, inputs, params)
    (grad_P,) = torch.autograd.grad(out.loss, lp_P, allow_unused=True)
    return out, torch.zeros_like(lp_P) if grad_P is None else grad_P


def reported(metrics: dict[str, tuple[float, float]]) -> dict[str, float]:
    return {name: num / den for name, (num, den) in metrics.items()}


# --------------------------------------------------------------------------------------------
# Naive reference (docs/semantics.md, token by token)
# --------------------------------------------------------------------------------------------


def clip(r: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    if r.item() < lo:
        return torch.tensor(lo, dtype=F64)
    if r.item() > hi:
        return torch.tensor(hi, dtype=F64)
    return r


def clipped_objective(r: torch.Tensor, a: float, lo: float, hi: float) -> torch.Tensor:
    plain, clipped = r * a, clip(r, lo, hi) * a
    return plain if plain.item() <= clipped.item() else clipped


def dppo_keep(lp: float, q: float, a: float, params: DppoParams) -> bool:
    p, p_old = math.exp(lp), math.exp(q)
    return p - p_old <= params.delta_high if a >= 0 else p_old - p <= params.delta_low


def ref_token(loss_type: str, s: Sample, t: int, lp: torch.Tensor, params: Any, seq: float):
    """ℓ_t for one kept token; `seq` is the sample's mean (lp - q) over kept tokens (GSPO)."""
    q, a = s["q"][t], s["A"][t]
    r = torch.exp(lp - q)
    if loss_type == "LOSS_TYPE_CROSS_ENTROPY":
        return -s["w"][t] * lp
    if loss_type == "LOSS_TYPE_IMPORTANCE_SAMPLING":
        cap = params.ratio_log_cap
        return -r * a if cap is None else -torch.exp(torch.clamp(lp - q, -cap, cap)) * a
    if loss_type == "LOSS_TYPE_PPO":
        return -clipped_objective(r, a, params.clip_low_threshold, params.clip_high_threshold)
    if loss_type == "LOSS_TYPE_CISPO":
        weight = clip(r, params.clip_low_threshold, params.clip_high_threshold).item()
        return -weight * a * lp
    if loss_type == "LOSS_TYPE_DRO":
        return -(a * lp - params.beta / 2 * (lp - q) ** 2)
    if loss_type == "LOSS_TYPE_DPPO":
        keep = dppo_keep(lp.item(), q, a, params)
        return -r * a if keep else lp * 0.0
    if loss_type == "LOSS_TYPE_STABLE_REINFORCE":  # §13: truncated IS weight, k3 to the sampler
        weight = min(r.item(), params.truncation)
        d = q - lp
        return -weight * a * lp + params.kl_coeff * (torch.exp(d) - d - 1)
    assert loss_type == "LOSS_TYPE_GRPO"
    if params.ratio_type == "GRPO_LOSS_RATIO_TYPE_SEQUENCE":
        rho = math.exp(seq) * torch.exp(lp - lp.detach())
    else:
        rho = r
    term = -clipped_objective(rho, a, params.clip_low_threshold, params.clip_high_threshold)
    if params.beta > 0:
        d = s["ref"][t] - lp
        term = term + params.beta * (torch.exp(d) - d - 1)
    return term


def reference(loss_type: str, samples: list[Sample], params: Any, lp_all: torch.Tensor):
    per_sample: list[list[torch.Tensor]] = []
    offset = 0
    for s in samples:
        kept = [t for t in range(len(s["lp"])) if s["m"][t] != 0]
        seq = 0.0
        if kept and loss_type != "LOSS_TYPE_CROSS_ENTROPY":
            seq = sum(s["lp"][t] - s["q"][t] for t in kept) / len(kept)
        terms = [ref_token(loss_type, s, t, lp_all[offset + t], params, seq) for t in kept]
        per_sample.append(terms)
        offset += len(s["lp"])
    zero = lp_all.sum() * 0.0
    total = sum((sum(terms, zero) for terms in per_sample), zero)
    if loss_type != "LOSS_TYPE_GRPO":
        return total
    agg = params.agg_type.removeprefix("GRPO_LOSS_AGGREGATION_TYPE_")
    if agg in ("TOKEN_MEAN", "UNSPECIFIED"):
        return total / max(1, sum(len(terms) for terms in per_sample))
    if agg == "SEQUENCE_MEAN":
        means = [sum(terms, zero) / max(1, len(terms)) for terms in per_sample]
        return sum(means, zero) / len(samples)
    assert agg == "FIXED_HORIZON"
    return total / (len(samples) * max(len(s["lp"]) for s in samples))


def ref_loss_and_grad(loss_type: str, samples: list[Sample], params: Any):
    lp_all = torch.tensor([x for s in samples for x in s["lp"]], dtype=F64, requires_grad=True)
    loss = reference(loss_type, samples, params, lp_all)
    (grad,) = torch.autograd.grad(loss, lp_all)
    return loss.detach(), grad


def ref_metrics(loss_type: str, samples: list[Sample], params: Any) -> dict[str, float]:
    """Hand-computed means over the call's kept tokens."""
    lps, ratios, kls, dropped = [], [], [], []
    for s in samples:
        kept = [t for t in range(len(s["lp"])) if s["m"][t] != 0]
        seq = sum(s["lp"][t] - s["q"][t] for t in kept) / max(1, len(kept))
        for t in kept:
            lps.append(s["lp"][t])
            sequence = getattr(params, "ratio_type", "") == "GRPO_LOSS_RATIO_TYPE_SEQUENCE"
            log_ratio = seq if sequence else s["lp"][t] - s["q"][t]
            cap = getattr(params, "ratio_log_cap", None)
            if cap is not None:
                log_ratio = min(cap, max(-cap, log_ratio))
            ratios.append(math.exp(log_ratio))
            d = s["ref"][t] - s["lp"][t]
            kls.append(math.exp(d) - d - 1)
            if loss_type == "LOSS_TYPE_DPPO":
                dropped.append(not dppo_keep(s["lp"][t], s["q"][t], s["A"][t], params))
    n = len(lps)
    out = {"loss/logprob/mean": sum(lps) / n}
    if loss_type == "LOSS_TYPE_CROSS_ENTROPY":
        return out
    out["loss/ratio/mean"] = sum(ratios) / n
    if loss_type in ("LOSS_TYPE_PPO", "LOSS_TYPE_CISPO", "LOSS_TYPE_GRPO"):
        out["loss/clip/low_fraction"] = sum(r < params.clip_low_threshold for r in ratios) / n
        out["loss/clip/high_fraction"] = sum(r > params.clip_high_threshold for r in ratios) / n
    if loss_type == "LOSS_TYPE_GRPO":
        out["loss/kl_ref/mean"] = sum(kls) / n
    if loss_type == "LOSS_TYPE_DPPO":
        out["loss/dppo/masked_fraction"] = sum(dropped) / n
    if loss_type == "LOSS_TYPE_STABLE_REINFORCE":
        c = params.truncation
        diffs = [s["lp"][t] - s["q"][t] for s in samples for t in range(len(s["lp"])) if s["m"][t]]
        out["loss/is_weight/mean"] = sum(min(r, c) for r in ratios) / n
        out["loss/truncated_fraction"] = sum(r > c for r in ratios) / n
        out["loss/log_ratio/mean"] = sum(diffs) / n
        out["loss/kl_sampler/mean"] = sum(math.exp(-d) + d - 1 for d in diffs) / n
    return out


# --------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------

CASES: list[tuple[str, Any]] = [
    ("LOSS_TYPE_CROSS_ENTROPY", CrossEntropyParams()),
    ("LOSS_TYPE_IMPORTANCE_SAMPLING", ImportanceSamplingParams()),
    ("LOSS_TYPE_IMPORTANCE_SAMPLING", ImportanceSamplingParams(ratio_log_cap=0.1)),
    ("LOSS_TYPE_PPO", PpoParams()),
    ("LOSS_TYPE_PPO", PpoParams(clip_low_threshold=0.9, clip_high_threshold=1.05)),
    ("LOSS_TYPE_CISPO", CispoParams()),
    ("LOSS_TYPE_CISPO", CispoParams(clip_low_threshold=0.9, clip_high_threshold=1.1)),
    ("LOSS_TYPE_DRO", DroParams(beta=0.0)),
    ("LOSS_TYPE_DRO", DroParams(beta=0.7)),
    ("LOSS_TYPE_DPPO", DppoParams()),
    ("LOSS_TYPE_DPPO", DppoParams(delta_low=0.05, delta_high=0.02)),
    ("LOSS_TYPE_STABLE_REINFORCE", StableReinforceParams()),
    ("LOSS_TYPE_STABLE_REINFORCE", StableReinforceParams(kl_coeff=0.3, truncation=1.1)),
] + [
    (
        "LOSS_TYPE_GRPO",
        GrpoParams.model_validate(
            {
                "agg_type": f"GRPO_LOSS_AGGREGATION_TYPE_{agg}",
                "ratio_type": f"GRPO_LOSS_RATIO_TYPE_{ratio}",
                "beta": beta,
            }
        ),
    )
    for agg in AGGS
    for ratio in ("TOKEN", "SEQUENCE")
    for beta in (0.0, 0.1)
]
POLICY_CASES = [case for case in CASES if case[0] != "LOSS_TYPE_CROSS_ENTROPY"]


def case_id(case: tuple[str, Any]) -> str:
    loss_type, params = case
    knobs = ",".join(f"{k}={v}" for k, v in params.model_dump().items())
    knobs = knobs.replace("GRPO_LOSS_AGGREGATION_TYPE_", "").replace("GRPO_LOSS_RATIO_TYPE_", "")
    return f"{loss_type.removeprefix('LOSS_TYPE_')}[{knobs}]"


def samples_for(loss_type: str) -> list[Sample]:
    return make_samples(seed=0, cross_entropy=loss_type == "LOSS_TYPE_CROSS_ENTROPY")


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.detach().to(F64), expected.to(F64), atol=1e-6, rtol=1e-5)


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------


def test_random_data_covers_the_interesting_regions():
    kept = [(s, t) for s in make_samples() for t in range(len(s["lp"])) if s["m"][t]]
    ratios = [math.exp(s["lp"][t] - s["q"][t]) for s, t in kept]
    assert min(ratios) < 0.8 and max(ratios) > 1.28
    assert any(s["A"][t] > 0 for s, t in kept) and any(s["A"][t] < 0 for s, t in kept)
    assert sum(make_samples()[ALL_MASKED]["m"]) == 0
    assert set(LOSSES) == set(LOSS_SPECS)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_loss_and_grad_match_reference(case):
    loss_type, params = case
    samples = samples_for(loss_type)
    out, grad_P = run(loss_type, samples, params)
    ref_loss, ref_grad = ref_loss_and_grad(loss_type, samples, params)
    assert out.loss.dtype == torch.float32 and out.loss.dim() == 0
    close(out.loss, ref_loss)
    close(grad_P, ref_grad)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_microbatches_sum_to_whole_call(case):
    loss_type, params = case
    samples = samples_for(loss_type)
    norm = norm_of(samples)
    whole, whole_grad = run(loss_type, samples, params)
    for split in SPLITS:
        parts = [run(loss_type, [samples[i] for i in group], params, norm) for group in split]
        close(sum(out.loss for out, _ in parts), whole.loss)
        close(torch.cat([grad for _, grad in parts]), whole_grad)
        summed = {
            name: (
                sum(out.metrics[name][0] for out, _ in parts),
                sum(o.metrics[name][1] for o, _ in parts),
            )
            for name in whole.metrics
        }
        assert reported(summed) == pytest.approx(reported(whole.metrics), abs=1e-6)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_metrics_match_hand_computed(case):
    loss_type, params = case
    samples = samples_for(loss_type)
    out, _ = run(loss_type, samples, params)
    expected = ref_metrics(loss_type, samples, params)
    assert set(out.metrics) == set(expected)
    assert reported(out.metrics) == pytest.approx(expected, abs=1e-6, rel=1e-5)
    assert all(isinstance(x, float) for pair in out.metrics.values() for x in pair)
    if loss_type in ("LOSS_TYPE_PPO", "LOSS_TYPE_GRPO"):  # both clip sides really occur
        assert 0 < expected["loss/clip/low_fraction"] < 1
        assert 0 < expected["loss/clip/high_fraction"] < 1


STEP0_CASES = [
    *POLICY_CASES,
    ("LOSS_TYPE_DPPO", DppoParams(delta_low=0.0, delta_high=0.0)),
    ("LOSS_TYPE_PPO", PpoParams(clip_low_threshold=1.0, clip_high_threshold=1.0)),
    ("LOSS_TYPE_CISPO", CispoParams(clip_low_threshold=1.0, clip_high_threshold=1.0)),
    ("LOSS_TYPE_GRPO", GrpoParams(clip_low_threshold=1.0, clip_high_threshold=1.0, beta=0.1)),
    (
        "LOSS_TYPE_GRPO",
        GrpoParams(
            clip_low_threshold=1.0,
            clip_high_threshold=1.0,
            ratio_type="GRPO_LOSS_RATIO_TYPE_SEQUENCE",
        ),
    ),
]


@pytest.mark.parametrize(
    "case",
    STEP0_CASES,
    ids=case_id,
)
def test_step0_invariants(case):
    """lp == q exactly: ratio 1, nothing clipped, nothing outside DPPO's region, k3 = 0.

    Clip fractions count ratios strictly outside [lo, hi], so lo = hi = 1 still reports 0.
    """
    loss_type, params = case
    samples = make_samples()
    for s in samples:
        s["q"] = list(s["lp"])
        s["ref"] = list(s["lp"])
    out, grad_P = run(loss_type, samples, params)
    metrics = reported(out.metrics)
    assert metrics["loss/ratio/mean"] == 1.0
    for name in ("loss/clip/low_fraction", "loss/clip/high_fraction", "loss/kl_ref/mean"):
        assert metrics.get(name, 0.0) == 0.0
    assert metrics.get("loss/dppo/masked_fraction", 0.0) == 0.0
    ref_loss, ref_grad = ref_loss_and_grad(loss_type, samples, params)
    close(out.loss, ref_loss)
    close(grad_P, ref_grad)


def test_grpo_token_mean_step0_gradient_is_minus_advantage_over_tokens():
    samples = make_samples()
    for s in samples:
        s["q"] = list(s["lp"])
    _, grad_P = run("LOSS_TYPE_GRPO", samples, GrpoParams())
    mask = torch.tensor([x for s in samples for x in s["m"]])
    adv = torch.tensor([x for s in samples for x in s["A"]])
    close(grad_P, -adv * mask / mask.sum())


def test_dppo_keep_rule_at_boundaries():
    # token:       0 A>0 at δ_high | 1 A>0 just above | 2 A<0 at δ_low | 3 A<0 just above |
    #              4 A>0 big drop | 5 A<0 big rise | 6 A=0 rise above δ_high | 7 A=0 big drop
    p = torch.tensor([0.60, 0.61, 0.40, 0.39, 0.05, 0.90, 0.70, 0.05])
    p_old = torch.tensor([0.40, 0.40, 0.60, 0.60, 0.90, 0.05, 0.40, 0.90])
    adv = [1.0, 1.5, -1.0, -0.5, 2.0, -2.0, 0.0, 0.0]
    lp_P, q_P = p.log(), p_old.log()
    diff = lp_P.exp() - q_P.exp()  # exactly the fp32 values the loss compares
    params = DppoParams(delta_high=float(diff[0]), delta_low=float(-diff[2]))
    sample = {"lp": lp_P.tolist(), "q": q_P.tolist(), "A": adv, "m": [1.0] * 8}
    sample.update(ref=sample["lp"], w=sample["m"])
    out, grad_P = run("LOSS_TYPE_DPPO", [sample], params)
    keep = [True, False, True, False, True, True, False, True]
    assert reported(out.metrics)["loss/dppo/masked_fraction"] == pytest.approx(3 / 8)
    for i in range(8):  # token by token, so the A = 0 tokens are checked on their own
        alone = {key: [values[i]] for key, values in sample.items()}
        alone_out, _ = run("LOSS_TYPE_DPPO", [alone], params)
        assert alone_out.metrics["loss/dppo/masked_fraction"] == (float(not keep[i]), 1.0), i
    ratio = (lp_P - q_P).exp()
    expected = torch.stack([-ratio[i] * adv[i] for i in range(8) if keep[i]]).sum()
    close(out.loss, expected)
    assert all(grad_P[i] == 0 for i in range(8) if not keep[i])
    assert all(grad_P[i] != 0 for i in range(6) if keep[i])


def test_dro_formula_and_required_beta():
    sample = {"lp": [-1.0, -2.0], "q": [-1.5, -1.0], "A": [2.0, -1.0], "m": [1.0, 1.0]}
    sample.update(ref=sample["lp"], w=sample["m"])
    out, grad_P = run("LOSS_TYPE_DRO", [sample], DroParams(beta=0.5))
    # -(2·(-1) - 0.25·0.25) - (-1·(-2) - 0.25·1) = 2.0625 - 1.75
    assert out.loss.item() == pytest.approx(2.0625 - 1.75)
    # dL/dlp = -(A - β·(lp - q)) = [-(2 - 0.25), -(-1 + 0.5)]
    assert grad_P.tolist() == pytest.approx([-1.75, 0.5])
    inputs, _ = build([sample], norm_of([sample]))
    with pytest.raises(ValueError, match="beta"):
        compute_loss("LOSS_TYPE_DRO", inputs, None)


def test_custom_loss_equals_cross_entropy_with_negated_weights():
    samples = make_samples(seed=3)
    inputs, lp_P = build(samples, norm_of(samples))
    g_P = torch.randn(lp_P.shape, generator=torch.Generator().manual_seed(1))
    custom = custom_loss(inputs, g_P)
    (custom_grad,) = torch.autograd.grad(custom.loss, lp_P)
    close(custom_grad, g_P * inputs.mask_P)

    weights_P = torch.where(inputs.mask_P != 0, -g_P, 0.0)
    ce_inputs, ce_lp_P = build(samples, norm_of(samples))
    ce_inputs = LossInputs(**{**ce_inputs.__dict__, "weights_P": weights_P})
    ce = compute_loss("LOSS_TYPE_CROSS_ENTROPY", ce_inputs, CrossEntropyParams())
    (ce_grad,) = torch.autograd.grad(ce.loss, ce_lp_P)
    close(custom.loss, ce.loss)
    close(custom_grad, ce_grad)


def poison(samples: list[Sample]) -> list[Sample]:
    """Copies with values at masked tokens that overflow exp() if they were not masked first."""
    out = [{key: list(values) for key, values in s.items()} for s in samples]
    masked = [(s, t) for s in out for t in range(len(s["lp"])) if s["m"][t] == 0]
    assert len(masked) >= 4
    for k, (s, t) in enumerate(masked):
        s["q"][t] = -1e4  # lp - q = 1e4
        s["ref"][t] = 1e4  # ref - lp = 1e4
        s["A"][t] = 1e30 if k % 2 else -1e30
        s["lp"][t] = [50.0, -1e4, float("-inf"), 100.0][k % 4]
    return out


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_masked_overflow_never_reaches_loss_or_grad(case):
    loss_type, params = case
    samples = samples_for(loss_type)
    clean, clean_grad = run(loss_type, samples, params)
    dirty, dirty_grad = run(loss_type, poison(samples), params)
    assert torch.isfinite(dirty.loss) and torch.isfinite(dirty_grad).all()
    assert all(math.isfinite(x) for pair in dirty.metrics.values() for x in pair)
    close(dirty.loss, clean.loss)
    close(dirty_grad, clean_grad)
    assert reported(dirty.metrics) == pytest.approx(reported(clean.metrics))


def test_custom_loss_ignores_masked_overflow():
    samples = make_samples()
    inputs, lp_P = build(poison(samples), norm_of(samples))
    g_P = torch.where(inputs.mask_P != 0, 1.0, 1e38)
    out = custom_loss(inputs, g_P)
    (grad_P,) = torch.autograd.grad(out.loss, lp_P)
    assert torch.isfinite(out.loss) and torch.isfinite(grad_P).all()
    close(grad_P, inputs.mask_P)


MISSING = [
    ("LOSS_TYPE_CROSS_ENTROPY", CrossEntropyParams(), "weights_P", "loss_fn_inputs.weights"),
    *[
        (loss_type, LOSS_SPECS[loss_type].params_cls(**extra), field, f"loss_fn_inputs.{name}")
        for loss_type, extra in [
            ("LOSS_TYPE_IMPORTANCE_SAMPLING", {}),
            ("LOSS_TYPE_PPO", {}),
            ("LOSS_TYPE_CISPO", {}),
            ("LOSS_TYPE_DRO", {"beta": 0.1}),
            ("LOSS_TYPE_DPPO", {}),
            ("LOSS_TYPE_GRPO", {}),
        ]
        for field, name in [("sampler_logprobs_P", "logprobs"), ("advantages_P", "advantages")]
    ],
    (
        "LOSS_TYPE_GRPO",
        GrpoParams(beta=0.1),
        "reference_logprobs_P",
        "loss_fn_inputs.reference_logprobs is required when grpo_params.beta > 0",
    ),
]


@pytest.mark.parametrize("loss_type,params,field,message", MISSING)
def test_missing_input_names_the_field(loss_type, params, field, message):
    samples = make_samples()
    inputs, _ = build(samples, norm_of(samples))
    inputs = LossInputs(**{**inputs.__dict__, field: None})
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        compute_loss(loss_type, inputs, params)


def test_grpo_without_reference_and_beta_zero_reports_no_kl():
    samples = make_samples()
    inputs, _ = build(samples, norm_of(samples))
    inputs = LossInputs(**{**inputs.__dict__, "reference_logprobs_P": None})
    out = compute_loss("LOSS_TYPE_GRPO", inputs, GrpoParams())
    assert isinstance(out, LossOutputs) and "loss/kl_ref/mean" not in out.metrics


def test_registry_defaults_and_unknown_type():
    samples = make_samples()
    inputs, _ = build(samples, norm_of(samples))
    default = compute_loss("LOSS_TYPE_PPO", inputs, None)
    explicit = compute_loss("LOSS_TYPE_PPO", inputs, PpoParams())
    assert default.loss.item() == explicit.loss.item()
    with pytest.raises(ValueError, match="LOSS_TYPE_NOPE"):
        compute_loss("LOSS_TYPE_NOPE", inputs, None)


def test_math_is_fp32_whatever_the_input_dtype():
    samples = make_samples()
    inputs, lp_P = build(samples, norm_of(samples), dtype=F64)
    out = compute_loss("LOSS_TYPE_GRPO", inputs, GrpoParams(beta=0.1))
    assert out.loss.dtype == torch.float32
    (grad_P,) = torch.autograd.grad(out.loss, lp_P)
    _, ref_grad = ref_loss_and_grad("LOSS_TYPE_GRPO", samples, GrpoParams(beta=0.1))
    close(grad_P, ref_grad)
