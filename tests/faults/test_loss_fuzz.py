"""Property tests of the loss inputs (hypothesis): whatever finite values a client sends, a loss is
finite or refused, masked positions never leak NaN/Inf, and splitting a call never changes it."""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainer.compute.losses import LossInputs, LossNorm, compute_loss
from trainer.contract.specs import LossConfig

POLICY_LOSSES = [
    ("LOSS_TYPE_IMPORTANCE_SAMPLING", {}),
    ("LOSS_TYPE_PPO", {}),
    ("LOSS_TYPE_CISPO", {}),
    ("LOSS_TYPE_DPPO", {}),
    ("LOSS_TYPE_DRO", {"dro_params": {"beta": 0.5}}),
    ("LOSS_TYPE_GRPO", {"grpo_params": {"beta": 0.1}}),
    (
        "LOSS_TYPE_GRPO",
        {
            "grpo_params": {
                "ratio_type": "GRPO_LOSS_RATIO_TYPE_SEQUENCE",
                "agg_type": "GRPO_LOSS_AGGREGATION_TYPE_SEQUENCE_MEAN",
            }
        },
    ),
    ("LOSS_TYPE_GRPO", {"grpo_params": {"agg_type": "GRPO_LOSS_AGGREGATION_TYPE_FIXED_HORIZON"}}),
]

finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)
logprob = st.floats(min_value=-1e4, max_value=0.0, allow_nan=False)
token = st.tuples(logprob, logprob, logprob, finite, st.booleans())
samples = st.lists(st.lists(token, min_size=1, max_size=6), min_size=1, max_size=5)


def _inputs(batch, lp_override=None) -> tuple[LossInputs, torch.Tensor]:
    rows = [t for s in batch for t in s]
    lp = torch.tensor([r[0] for r in rows], dtype=torch.float32, requires_grad=True)
    index = torch.tensor([i for i, s in enumerate(batch) for _ in s])
    mask = torch.tensor([float(r[4]) for r in rows])
    norm = LossNorm(float(mask.sum()), len(batch), max(len(s) for s in batch))
    return (
        LossInputs(
            logprobs_P=lp,
            sample_index_P=index,
            num_samples=len(batch),
            mask_P=mask,
            norm=norm,
            sampler_logprobs_P=torch.tensor([r[1] for r in rows]),
            reference_logprobs_P=torch.tensor([r[2] for r in rows]),
            advantages_P=torch.tensor([r[3] for r in rows]),
        ),
        lp,
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=samples, which=st.integers(0, len(POLICY_LOSSES) - 1))
def test_masked_positions_never_leak(batch, which) -> None:
    """Changing the values at masked positions changes neither the loss nor the gradient."""
    loss_type, extra = POLICY_LOSSES[which]
    params = LossConfig(type=loss_type, **extra).params()
    inputs, lp = _inputs(batch)
    out = compute_loss(loss_type, inputs, params)
    if not torch.isfinite(out.loss):
        return  # the engine refuses this call with NON_FINITE_LOSS; nothing to compare
    out.loss.backward()
    assert lp.grad is not None
    if not torch.isfinite(lp.grad).all():
        # a kept ratio beyond fp32 (log-ratio > 88) makes exp's gradient inf·0; the engine
        # refuses such a call with NON_FINITE_LOSS, so it never reaches the weights
        return
    poisoned = [
        [
            t if t[4] else (-1e30 if i % 2 else 0.0, -1e30, 1e30, 1e30, False)
            for i, t in enumerate(s)
        ]
        for s in batch
    ]
    inputs2, lp2 = _inputs(poisoned)
    out2 = compute_loss(loss_type, inputs2, params)
    out2.loss.backward()
    assert torch.equal(out.loss.detach(), out2.loss.detach()) or math.isclose(
        float(out.loss), float(out2.loss), rel_tol=1e-6, abs_tol=1e-6
    )
    assert lp2.grad is not None and torch.isfinite(lp2.grad).all()
    keep = inputs.mask_P != 0
    torch.testing.assert_close(lp.grad[keep], lp2.grad[keep], rtol=1e-5, atol=1e-6)
    assert (lp2.grad[~keep] == 0).all()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=samples, which=st.integers(0, len(POLICY_LOSSES) - 1), cut=st.integers(1, 4))
def test_split_calls_sum_to_the_whole(batch, which, cut) -> None:
    loss_type, extra = POLICY_LOSSES[which]
    params = LossConfig(type=loss_type, **extra).params()
    whole, _ = _inputs(batch)
    total = compute_loss(loss_type, whole, params).loss
    if not torch.isfinite(total) or len(batch) <= cut:
        return
    parts = []
    for chunk in (batch[:cut], batch[cut:]):
        part, _ = _inputs(chunk)
        part = LossInputs(**{**part.__dict__, "norm": whole.norm})
        parts.append(compute_loss(loss_type, part, params).loss.detach())
    assert math.isclose(float(sum(parts)), float(total.detach()), rel_tol=1e-4, abs_tol=1e-3)
