"""The tuned logprob head (`trainer.compute.logprobs`) against naive full-logits references."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from trainer.compute.logprobs import linear_terms, naive_token_logprobs, token_logprobs


def _grads(params: list[torch.Tensor]) -> list[torch.Tensor | None]:
    out = [None if p.grad is None else p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return out


def _both(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, chunk: int, seed: int = 0):
    """(ours, naive): logprobs and the gradients of Σ g·lp for hidden and every head param."""
    params = [hidden, *(p for p in head.parameters() if p.requires_grad)]
    g = torch.randn(hidden.shape[0], generator=torch.Generator().manual_seed(99))
    torch.manual_seed(seed)
    ours, _ = token_logprobs(hidden, head, targets, chunk_tokens=chunk)
    (ours * g).sum().backward()
    ours_grads = _grads(params)
    torch.manual_seed(seed)
    ref = naive_token_logprobs(hidden, head, targets)
    (ref * g).sum().backward()
    return (ours, ours_grads), (ref, _grads(params))


def _assert_close(a, b, atol: float = 1e-5) -> None:
    (lp_a, grads_a), (lp_b, grads_b) = a, b
    torch.testing.assert_close(lp_a, lp_b, atol=atol, rtol=0)
    for ga, gb in zip(grads_a, grads_b):
        assert (ga is None) == (gb is None)
        if ga is not None:
            torch.testing.assert_close(ga, gb, atol=atol, rtol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_linear_head_matches_naive(bias: bool, chunk: int) -> None:
    torch.manual_seed(0)
    head = nn.Linear(16, 500, bias=bias)
    hidden = torch.randn(61, 16, requires_grad=True)
    targets = torch.randint(0, 500, (61,))
    _assert_close(*_both(head, hidden, targets, chunk))


def test_frozen_head_gets_no_weight_gradient() -> None:
    torch.manual_seed(1)
    head = nn.Linear(8, 300, bias=False).requires_grad_(False)
    hidden = torch.randn(40, 8, requires_grad=True)
    targets = torch.randint(0, 300, (40,))
    ours, ref = _both(head, hidden, targets, 16)
    _assert_close(ours, ref)
    assert head.weight.grad is None


@pytest.mark.parametrize("dropout", [0.0, 0.25])
def test_lora_head_matches_naive(dropout: float) -> None:
    """A peft LoRA around lm_head (train_unembed) takes the fast path, dropout included."""
    from peft import LoraConfig, get_peft_model

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm_head = nn.Linear(16, 400, bias=False)

    torch.manual_seed(2)
    config = LoraConfig(
        r=4, target_modules=["lm_head"], lora_dropout=dropout, init_lora_weights=False
    )
    model = get_peft_model(Tiny(), config)
    model.train()
    head = model.base_model.model.lm_head
    hidden = torch.randn(50, 16, requires_grad=True)
    assert linear_terms(head, hidden) is not None
    targets = torch.randint(0, 400, (50,))
    _assert_close(*_both(head, hidden, targets, 16, seed=3))


def test_other_heads_fall_back_to_checkpointing() -> None:
    torch.manual_seed(4)
    head = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 100))
    hidden = torch.randn(30, 8, requires_grad=True)
    targets = torch.randint(0, 100, (30,))
    assert linear_terms(head, hidden) is None
    _assert_close(*_both(head, hidden, targets, 8))


def test_bf16_head_keeps_fp32_softmax_math() -> None:
    """bf16 matmuls, fp32 log-sum-exp: equal to fp32 math on the same bf16 logits."""
    torch.manual_seed(5)
    head = nn.Linear(32, 700, bias=False).to(torch.bfloat16)
    hidden = torch.randn(45, 32, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 700, (45,))
    lp, _ = token_logprobs(hidden, head, targets, chunk_tokens=16)
    assert lp.dtype == torch.float32
    expected = naive_token_logprobs(hidden, head, targets)  # bf16 logits, fp32 log-softmax
    torch.testing.assert_close(lp, expected, atol=1e-5, rtol=0)
    lp.sum().backward()
    assert hidden.grad is not None and hidden.grad.dtype == torch.bfloat16
    assert head.weight.grad is not None and torch.isfinite(head.weight.grad.float()).all()


def test_forward_only_entropy_and_logprobs() -> None:
    torch.manual_seed(6)
    head = nn.Linear(8, 90)
    hidden = torch.randn(23, 8)
    targets = torch.randint(0, 90, (23,))
    with torch.no_grad():
        lp, entropy = token_logprobs(hidden, head, targets, chunk_tokens=5, with_entropy=True)
        logp = torch.log_softmax(head(hidden), -1)
    torch.testing.assert_close(lp, logp.gather(-1, targets[:, None]).squeeze(-1), atol=1e-5, rtol=0)
    assert entropy is not None
    torch.testing.assert_close(entropy, -(logp.exp() * logp).sum(-1), atol=1e-5, rtol=0)


def test_backward_saves_no_token_by_vocab_tensor() -> None:
    torch.manual_seed(7)
    n, v = 128, 2048
    head = nn.Linear(8, v, bias=False)
    hidden = torch.randn(n, 8, requires_grad=True)
    targets = torch.randint(0, v, (n,))
    saved: list[tuple[int, ...]] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        lp, _ = token_logprobs(hidden, head, targets, chunk_tokens=16)
    assert all(math.prod(shape) < n * v // 8 for shape in saved), saved
    lp.sum().backward()


def test_extreme_logits_stay_finite() -> None:
    head = nn.Linear(4, 50, bias=False)
    with torch.no_grad():
        head.weight.mul_(1e4)
    hidden = torch.randn(10, 4, requires_grad=True)
    targets = torch.randint(0, 50, (10,))
    lp, _ = token_logprobs(hidden, head, targets, chunk_tokens=3)
    lp.sum().backward()
    assert torch.isfinite(lp).all() and hidden.grad is not None
    assert torch.isfinite(hidden.grad).all()
