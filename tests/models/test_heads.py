"""The trainer's head reproduces the model's logit transform (soft-capping, a scale) in its
chunked logprobs, values and gradients, against plain autograd through the full logits."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainer.compute.architecture import Head, OutputHead
from trainer.compute.logprobs import token_logprobs


def _reference(hidden: torch.Tensor, head: nn.Linear, transform: Head, targets: torch.Tensor):
    logits = head(hidden)
    if transform.softcap is not None:
        logits = torch.tanh(logits / transform.softcap) * transform.softcap
    logits = logits * transform.scale
    return torch.log_softmax(logits.float(), -1).gather(-1, targets[:, None]).squeeze(-1)


@pytest.mark.parametrize(
    "transform", [Head(softcap=5.0), Head(scale=0.25), Head(softcap=3.0, scale=2.0)]
)
def test_transformed_head_values_and_gradients(transform: Head) -> None:
    gen = torch.Generator().manual_seed(0)
    head = nn.Linear(16, 40, bias=True)
    with torch.no_grad():
        head.weight.copy_(torch.randn(40, 16, generator=gen) * 2)
        head.bias.copy_(torch.randn(40, generator=gen))
    hidden = (torch.randn(23, 16, generator=gen) * 2).requires_grad_(True)
    targets = torch.randint(0, 40, (23,), generator=gen)
    upstream = torch.randn(23, generator=gen)

    ours, _ = token_logprobs(hidden, OutputHead(head, transform), targets, chunk_tokens=7)
    (ours * upstream).sum().backward()
    got = (hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone())
    hidden.grad = head.weight.grad = head.bias.grad = None

    want = _reference(hidden, head, transform, targets)
    (want * upstream).sum().backward()
    torch.testing.assert_close(ours, want, atol=1e-5, rtol=1e-5)
    for a, b in zip(got, (hidden.grad, head.weight.grad, head.bias.grad), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    plain, _ = token_logprobs(hidden.detach(), head, targets)
    assert (plain - want.detach()).abs().max() > 1e-2  # the transform matters here
