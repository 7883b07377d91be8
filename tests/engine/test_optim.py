"""`trainer/compute/optim.py` in one process equals torch's own norm and clipping, bit for bit."""

from __future__ import annotations

import pytest
import torch

from trainer.compute import optim
from trainer.compute.placement import Solo
from trainer.contract.errors import OperationError
from trainer.contract.specs import AdamParams


def _params(seed: int, scale: float = 1.0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = []
    for shape in [(7, 5), (5,), (3, 3, 2)]:
        p = torch.nn.Parameter(torch.randn(shape, generator=gen))
        p.grad = torch.randn(shape, generator=gen) * scale
        params.append(p)
    return params


def test_grad_norm_and_clipping_equal_torch() -> None:
    ours, ref = _params(0, scale=10.0), _params(0, scale=10.0)
    grads = [p.grad for p in ours if p.grad is not None]
    norm = optim.grad_norm(grads, Solo())
    expected = torch.nn.utils.get_total_norm([p.grad for p in ref if p.grad is not None])
    assert norm == float(expected)
    optim.clip_grads_(ours, 1.5, norm)
    torch.nn.utils.clip_grads_with_norm_(ref, 1.5, torch.tensor(norm))
    for a, b in zip(ours, ref, strict=True):
        assert torch.equal(a.grad, b.grad)


def test_adamw_step_equals_torch_adamw_and_refuses_a_non_finite_norm() -> None:
    ours, ref = _params(1), _params(1)
    adam = AdamParams(learning_rate=1e-2, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.1)
    metrics = optim.adamw_step(optim.new_adamw(ours), ours, adam, Solo())
    norm = float(torch.nn.utils.get_total_norm([p.grad for p in ref if p.grad is not None]))
    assert norm > adam.grad_clip_norm == 1.0  # the default clips
    torch.nn.utils.clip_grads_with_norm_(ref, 1.0, torch.tensor(norm))
    torch.optim.AdamW(ref, lr=1e-2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1).step()
    assert metrics == {"grad_norm": norm, "grad_norm_clipped": 1.0, "learning_rate": 1e-2}
    for a, b in zip(ours, ref, strict=True):
        assert torch.equal(a.detach(), b.detach()) and a.grad is None
    bad = _params(2)
    assert bad[0].grad is not None
    bad[0].grad[0, 0] = float("inf")
    before = [p.detach().clone() for p in bad]
    with pytest.raises(OperationError) as err:
        optim.adamw_step(optim.new_adamw(bad), bad, adam, Solo())
    assert err.value.code == "NON_FINITE_LOSS"
    assert all(torch.equal(p.detach(), b) for p, b in zip(bad, before, strict=True))
