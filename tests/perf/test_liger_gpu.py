"""The optional liger-kernel backend against our head (CUDA + liger-kernel only)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainer.compute.logprobs import liger_available, token_logprobs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not liger_available(), reason="needs CUDA and liger-kernel"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_liger_matches_ours(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    head = nn.Linear(256, 32000, bias=False, device="cuda", dtype=dtype)
    hidden = torch.randn(1000, 256, device="cuda", dtype=dtype, requires_grad=True)
    targets = torch.randint(0, 32000, (1000,), device="cuda")
    g = torch.randn(1000, device="cuda")
    out = {}
    for backend in ("ours", "liger"):
        lp, _ = token_logprobs(hidden, head, targets, chunk_tokens=256, backend=backend)
        assert lp.dtype == torch.float32
        (lp * g).sum().backward()
        out[backend] = (lp.detach(), hidden.grad.float(), head.weight.grad.float())
        hidden.grad = None
        head.weight.grad = None
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for ours, liger in zip(out["ours"], out["liger"]):
        torch.testing.assert_close(liger, ours, atol=tol, rtol=tol)
