"""Rows 1 and 3: the logprob head against naive full logits, and a step against matmul peak."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from benchmarks.harness import Measurement, measure
from benchmarks.shapes import ModelShape, shape_from
from trainer.compute.logprobs import naive_token_logprobs, token_logprobs


def _head_case(params: dict[str, Any]) -> tuple[nn.Linear, torch.Tensor, torch.Tensor, Any]:
    shape = shape_from(params)
    torch.manual_seed(params.get("seed", 0))
    head = nn.Linear(shape.hidden, shape.vocab, bias=False)
    hidden = torch.randn(params["tokens"], shape.hidden, requires_grad=True)
    targets = torch.randint(0, shape.vocab, (params["tokens"],))
    grad = torch.randn(params["tokens"])
    return head, hidden, targets, grad


def head_arm(params: dict[str, Any]) -> Measurement:
    """Per-token logprobs + backward (input and weight gradients) at T tokens.

    `params["impl"]`: "ours" (chunked, custom backward) or "naive" (full fp32 `[T, V]` logits).
    With `params["dump"]`, the logprobs and gradients of one extra step are saved there.
    """
    head, hidden, targets, grad = _head_case(params)
    chunk = params.get("chunk", 1024)

    def logprobs() -> torch.Tensor:
        if params["impl"] == "naive":
            return naive_token_logprobs(hidden, head, targets)
        return token_logprobs(hidden, head, targets, chunk_tokens=chunk)[0]

    def step() -> None:
        (logprobs() * grad).sum().backward()

    def zero() -> None:
        hidden.grad = None
        head.weight.grad = None

    result = measure(step, reps=params["reps"], warmup=params.get("warmup", 0), after=zero)
    if params.get("dump"):
        from safetensors.torch import save_file

        lp = logprobs()
        (lp * grad).sum().backward()
        assert hidden.grad is not None and head.weight.grad is not None
        save_file(
            {"logprobs": lp.detach(), "grad_hidden": hidden.grad, "grad_weight": head.weight.grad},
            params["dump"],
        )
    return result


def matmul_rate(n: int = 2048, reps: int = 3) -> float:
    """Best fp32 FLOP/s of an `n³` matmul over `reps` tries: this machine's practical peak."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = 0.0
    for _ in range(reps):
        start = time.perf_counter()
        a @ b
        best = max(best, 2 * n**3 / (time.perf_counter() - start))
    return best


def step_flops(shape: ModelShape, tokens: int, seq_len: int, lora: bool = False) -> float:
    """Model FLOPs of one training step (recompute not counted): 6·N·T + attention.

    Attention: 12 · layers · q_dim · seq_len per token (PaLM's convention). N counts the matmul
    parameters: decoder + output head (the embedding lookup is not a matmul).
    """
    counts = shape.params()
    n = counts["decoder"] + shape.vocab * shape.hidden
    attention = 12 * shape.layers * shape.heads * shape.head_dim * seq_len
    per_token = (4 if lora else 6) * n + attention
    return float(per_token * tokens)


def mfu_arm(params: dict[str, Any]) -> Measurement:
    """A full-weights training step (forward-backward + optim-step) through the engine.

    The matmul peak is measured in the same process right before each step, so the ratio sees
    the same machine load. `extra`: flops per step, matmul peak FLOP/s per rep.
    """
    from benchmarks.engine_setup import ce_samples, make_resource, make_session
    from benchmarks.shapes import rl_batch
    from trainer.contract.specs import AdamParams, LossConfig

    shape = shape_from(params)
    resource = make_resource(params["model_dir"], lora=False, options=params.get("options"))
    session = make_session(resource)
    n, length = params["samples"], params["length"]
    batch = rl_batch(0, n, (1, 1), (length, length), shape.vocab)
    samples = ce_samples(batch)
    loss = LossConfig(type="LOSS_TYPE_CROSS_ENTROPY")
    adam = AdamParams()
    peaks: list[float] = []

    def step() -> None:
        session.forward_backward(loss, samples)
        session.optim_step(adam)

    def between() -> None:
        peaks.append(matmul_rate())

    between()
    result = measure(step, reps=params["reps"], warmup=params.get("warmup", 1), after=between)
    tokens = sum(len(s.model_input.tokens) for s in samples)
    result.extra = {
        "flops": step_flops(shape, tokens, length),
        "matmul_peaks": peaks,
        "tokens": tokens,
    }
    return result
