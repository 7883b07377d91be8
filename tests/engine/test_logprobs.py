"""Chunked logprobs equal the naive full-logits ones, in values and gradients."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from trainer.compute.logprobs import naive_token_logprobs, token_logprobs


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
@pytest.mark.parametrize("lora_head", [False, True])
def test_chunked_equals_naive(chunk: int, lora_head: bool) -> None:
    torch.manual_seed(0)
    n, h, v = 53, 16, 97
    head = nn.Linear(h, v, bias=False)
    if lora_head:
        from peft import LoraConfig, get_peft_model

        wrapper = nn.Sequential()
        wrapper.add_module("lm_head", head)
        peft_model = get_peft_model(
            wrapper, LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head"], lora_dropout=0.0)
        )
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.normal_()
        head = peft_model.base_model.model.lm_head
    hidden = torch.randn(n, h, requires_grad=True)
    targets = torch.randint(0, v, (n,))
    params = [hidden, *[p for p in head.parameters() if p.requires_grad]]

    ours, _ = token_logprobs(hidden, head, targets, chunk_tokens=chunk)
    weights = torch.randn(n)
    ours_grads = torch.autograd.grad((ours * weights).sum(), params)

    ref = naive_token_logprobs(hidden, head, targets)
    ref_grads = torch.autograd.grad((ref * weights).sum(), params)

    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
    for a, b in zip(ours_grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_entropy_matches_definition() -> None:
    torch.manual_seed(1)
    head = nn.Linear(8, 11, bias=False)
    hidden = torch.randn(9, 8)
    targets = torch.randint(0, 11, (9,))
    _, entropy = token_logprobs(hidden, head, targets, chunk_tokens=4, with_entropy=True)
    probs = torch.softmax(head(hidden), -1)
    expected = -(probs * probs.log()).sum(-1)
    assert entropy is not None
    torch.testing.assert_close(entropy, expected, atol=1e-5, rtol=0)


def test_no_full_logits_in_backward_memory() -> None:
    """The saved activations of the graph hold no [N, V] tensor: only hidden states."""
    torch.manual_seed(2)
    n, h, v = 256, 8, 4096
    head = nn.Linear(h, v, bias=False)
    hidden = torch.randn(n, h, requires_grad=True)
    targets = torch.randint(0, v, (n,))
    saved: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, _ = token_logprobs(hidden, head, targets, chunk_tokens=32)
    assert lp.shape == (n,)
    # the head weight [V, H] may be saved (a reference, not a copy); no [N, V]-sized tensor is
    assert all(math.prod(shape) < n * v for shape in saved), saved
