"""Per-token logprobs of the target tokens, from hidden states, chunked over tokens.

Targets are `[N]` (one per position) or `[N, K]` (soft targets: K per position), and so are the
logprobs: every one of a position's K is gathered from that position's one log-softmax, so K
targets cost one head matmul per position, not K.

Design notes: `docs/design/compute.md`.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainer.compute.architecture import Head, OutputHead, output_head
from trainer.contract.options import CHUNK_TOKENS

if TYPE_CHECKING:
    from trainer.compute.batch import MicroBatch

DEFAULT_CHUNK_TOKENS = CHUNK_TOKENS


def _lse_(logits_C_V: torch.Tensor) -> torch.Tensor:
    """fp32 log-sum-exp over the last dim. Overwrites `logits_C_V` with `exp(logits - max)`."""
    max_C = logits_C_V.amax(dim=-1)
    max_C = torch.where(torch.isfinite(max_C), max_C, torch.zeros_like(max_C))
    sum_C = logits_C_V.sub_(max_C[:, None]).exp_().sum(dim=-1)
    return max_C + sum_C.log()


Term = tuple[torch.Tensor, torch.Tensor]  # (x_N_I, weight_V_I): logits += x @ weight.T


def _pick(logits_C_V: torch.Tensor, targets_C: torch.Tensor) -> torch.Tensor:
    """The logits of the targets: `[C]` for `[C]` targets, `[C, K]` for `[C, K]` ones."""
    if targets_C.ndim == 1:
        return logits_C_V.gather(-1, targets_C[:, None]).squeeze(-1)
    return logits_C_V.gather(-1, targets_C)


def _rows(x_C: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-position `[C]` value against `like` (`[C]`, or `[C, K]`: one column per target)."""
    return x_C if like.ndim == 1 else x_C[:, None]


def _logits(terms: list[Term], start: int, end: int, bias_V: torch.Tensor | None) -> torch.Tensor:
    """fp32 `Σ x[start:end] @ W.T (+ b)` for one chunk of tokens."""
    x0, w0 = terms[0]
    out = nn.functional.linear(x0[start:end], w0, bias_V)
    out = out if out.dtype == torch.float32 else out.float()
    for x, w in terms[1:]:
        if x.dtype == w.dtype == torch.float32:
            out.addmm_(x[start:end], w.T)  # in place: no second [C, V] buffer
        else:
            out += (x[start:end] @ w.T).float()
    return out


def _transform_(z_C_V: torch.Tensor, head: Head | None) -> torch.Tensor | None:
    """In place, the model's logit transform (`architecture.Head`): `z` becomes
    `scale · c · tanh(z / c)` (or `scale · z`). Returns `dy/dz` where it is not a constant
    (soft-capping: `scale · (1 − tanh²)`), else None."""
    if head is None or head.identity:
        return None
    deriv = None
    if head.softcap is not None:
        tanh = z_C_V.div_(head.softcap).tanh_()
        deriv = (1 - tanh * tanh).mul_(head.scale)
        tanh.mul_(head.softcap)
    if head.scale != 1.0:
        z_C_V.mul_(head.scale)
    return deriv


class _LinearLogprobs(torch.autograd.Function):
    """`log softmax(f(Σ_i x_i @ W_i.T + b))[targets]` over token chunks (module docstring), for
    `[N]` or `[N, K]` targets; `f` is the model's logit transform (`architecture.Head`:
    soft-capping, a scale), or the identity.

    A plain head is one term `(hidden, W)`; a LoRA head adds `(scale · A(dropout(hidden)), B)`,
    whose `[N, r]` input is computed (with its dropout) once, outside, under autograd.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        targets_N: torch.Tensor,
        chunk_tokens: int,
        bias_V: torch.Tensor | None,
        transform: Head | None,
        *flat_terms: torch.Tensor,
    ) -> torch.Tensor:
        terms = list(zip(flat_terms[0::2], flat_terms[1::2]))
        n = targets_N.shape[0]
        logprobs_N = flat_terms[0].new_empty(targets_N.shape, dtype=torch.float32)
        lse_N = flat_terms[0].new_empty(n, dtype=torch.float32)
        for start in range(0, n, chunk_tokens):
            end = min(start + chunk_tokens, n)
            logits_C_V = _logits(terms, start, end, bias_V)
            _transform_(logits_C_V, transform)
            target_C = _pick(logits_C_V, targets_N[start:end])
            lse_C = _lse_(logits_C_V)
            del logits_C_V
            lse_N[start:end] = lse_C
            logprobs_N[start:end] = target_C - _rows(lse_C, target_C)
        # Activations (the x's) are saved; the head's weights are held by reference: they are
        # alive anyway, and saved-tensor hooks (offloading, memory audits) should not see them.
        ctx.save_for_backward(targets_N, lse_N, *flat_terms[0::2])
        ctx.weights, ctx.bias = flat_terms[1::2], bias_V
        ctx.chunk_tokens = chunk_tokens
        ctx.transform = transform
        return logprobs_N

    @staticmethod
    def backward(ctx: Any, grad_N: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        targets_N, lse_N, *xs = ctx.saved_tensors
        weights, bias_V = ctx.weights, ctx.bias
        terms = list(zip(xs, weights))
        needs = ctx.needs_input_grad
        need_b = needs[2]
        need_x = needs[4::2]
        need_w = needs[5::2]
        grad_N = grad_N.float()
        n = targets_N.shape[0]
        grad_x = [torch.empty_like(x) if need else None for x, need in zip(xs, need_x)]
        # weight gradients accumulate in fp32 across chunks, whatever the weights' dtype
        grad_w = [
            torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need else None
            for w, need in zip(weights, need_w)
        ]
        grad_b = torch.zeros(bias_V.shape, device=bias_V.device) if need_b else None
        for start in range(0, n, ctx.chunk_tokens):
            end = min(start + ctx.chunk_tokens, n)
            g_C_K = grad_N[start:end].reshape(end - start, -1)  # [C, K]; K = 1 for [N] targets
            targets_C_K = targets_N[start:end].reshape(end - start, -1)
            # d lp_k / d logits = onehot(target_k) − softmax, so the position's gradient is
            # Σ_k g_k·onehot(target_k) − (Σ_k g_k)·softmax, in place.
            dlogits_C_V = _logits(terms, start, end, bias_V)
            deriv_C_V = _transform_(dlogits_C_V, ctx.transform)
            dlogits_C_V.sub_(lse_N[start:end, None]).exp_().mul_(-g_C_K.sum(-1, keepdim=True))
            dlogits_C_V.scatter_add_(1, targets_C_K, g_C_K)
            if deriv_C_V is not None:  # through the transform, back to the head's output
                dlogits_C_V.mul_(deriv_C_V)
                del deriv_C_V
            elif ctx.transform is not None and ctx.transform.scale != 1.0:
                dlogits_C_V.mul_(ctx.transform.scale)
            cast: dict[torch.dtype, torch.Tensor] = {torch.float32: dlogits_C_V}
            for i, (x, w) in enumerate(terms):
                d = cast.get(w.dtype)
                if d is None:
                    d = cast[w.dtype] = dlogits_C_V.to(w.dtype)
                gx, gw = grad_x[i], grad_w[i]
                if gx is not None:
                    gx[start:end] = d @ w
                if gw is not None:
                    if d.dtype == torch.float32 and x.dtype == torch.float32:
                        gw.addmm_(d.T, x[start:end])
                    else:
                        gw += (d.T @ x[start:end]).float()
            if grad_b is not None:
                grad_b += dlogits_C_V.sum(0)
            del dlogits_C_V, cast, d  # free this chunk's [C, V] before the next one
        out: list[Any] = [None, None, None if grad_b is None else grad_b.to(bias_V.dtype), None]
        for i, (_, w) in enumerate(terms):
            gw = grad_w[i]
            out += [grad_x[i], None if gw is None else gw.to(w.dtype)]
        return tuple(out)


def linear_terms(
    head: nn.Module, hidden_N_H: torch.Tensor
) -> tuple[list[Term], torch.Tensor | None] | None:
    """The head as a sum of linear terms, or None when it is not one we can decompose.

    `nn.Linear` → `[(hidden, W)]`. A peft LoRA `Linear` (vanilla LoRA, not merged, no LoRA
    bias) → `[(hidden, W), (scale · A(dropout(hidden)), B)]` per active adapter; the small
    `[N, r]` products run here, under autograd, with the adapter's own dropout module.
    """
    if type(head) is nn.Linear:
        return [(hidden_N_H, head.weight)], head.bias
    lora: Any = head  # a peft LoraLayer, duck-typed (peft is not imported here)
    base = getattr(head, "base_layer", None)
    lora_a = getattr(head, "lora_A", None)
    if type(base) is not nn.Linear or lora_a is None:
        return None
    if getattr(head, "disable_adapters", False):
        return [(hidden_N_H, base.weight)], base.bias
    if getattr(head, "merged", True) or getattr(head, "lora_variant", {}):
        return None
    terms: list[Term] = [(hidden_N_H, base.weight)]
    for name in lora.active_adapters:
        if name not in lora_a:
            continue
        down, up = lora_a[name], lora.lora_B[name]
        if type(down) is not nn.Linear or type(up) is not nn.Linear:
            return None
        if down.bias is not None or up.bias is not None:
            return None
        x = lora.lora_dropout[name](hidden_N_H.to(down.weight.dtype))
        terms.append((down(x) * lora.scaling[name], up.weight))
    return terms, base.bias


def _chunk_logprobs(
    head: nn.Module, hidden_C_H: torch.Tensor, targets_C: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    logits_C_V = head(hidden_C_H).float()
    target_logits_C = _pick(logits_C_V, targets_C)
    max_C = logits_C_V.detach().amax(dim=-1, keepdim=True)
    lse_C = (logits_C_V - max_C).exp().sum(-1).log() + max_C.squeeze(-1)
    return target_logits_C - _rows(lse_C, target_logits_C), lse_C


def token_logprobs(
    hidden_N_H: torch.Tensor,
    head: nn.Module,
    targets_N: torch.Tensor,
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    with_entropy: bool = False,
    backend: str = "ours",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return (`logprobs_N` fp32, `entropy_N` fp32 without gradient, or None).

    `logprobs_N[i] = log softmax(head(hidden_N_H[i]))[targets_N[i]]`; for `[N, K]` targets
    `logprobs_N_K[i, k]` is the same log softmax at `targets_N_K[i, k]` (one softmax per
    position), and the entropy stays `[N]`.
    `backend`: "ours", or "liger" (liger-kernel's
    fused linear cross entropy, used only on CUDA, for a plain `nn.Linear` head, without
    entropy, when the package is installed; ours otherwise).
    """
    if hidden_N_H.shape[0] != targets_N.shape[0]:
        raise ValueError("hidden states and targets must have the same number of tokens")
    if chunk_tokens < 1:
        raise ValueError("chunk_tokens must be at least 1")
    if targets_N.ndim not in (1, 2):
        raise ValueError("targets must be [N] or [N, K]")
    if hidden_N_H.shape[0] == 0:
        empty = hidden_N_H.new_zeros(0, dtype=torch.float32)
        return empty.new_zeros(targets_N.shape), (empty if with_entropy else None)
    needs_grad = torch.is_grad_enabled() and (
        hidden_N_H.requires_grad or any(p.requires_grad for p in head.parameters())
    )
    if with_entropy or not needs_grad:
        with torch.set_grad_enabled(needs_grad):
            return _forward_only(hidden_N_H, head, targets_N, chunk_tokens, with_entropy)
    if targets_N.ndim == 1 and _use_liger(backend, head, hidden_N_H):
        assert isinstance(head, nn.Linear)
        return liger_token_logprobs(hidden_N_H, head.weight, head.bias, targets_N), None
    transform = head.transform if isinstance(head, OutputHead) else None
    inner = head.head if isinstance(head, OutputHead) else head
    decomposed = linear_terms(inner, hidden_N_H)
    if decomposed is not None:
        terms, bias = decomposed
        flat = [t for term in terms for t in term]
        logprobs = _LinearLogprobs.apply(targets_N, chunk_tokens, bias, transform, *flat)
        return logprobs, None
    parts = []
    for start in range(0, hidden_N_H.shape[0], chunk_tokens):
        hidden = hidden_N_H[start : start + chunk_tokens]
        targets = targets_N[start : start + chunk_tokens]
        lp, _ = checkpoint(_chunk_logprobs, head, hidden, targets, use_reentrant=False)
        parts.append(lp)
    return torch.cat(parts), None


def batch_logprobs(
    model: Any,
    batch: MicroBatch,
    device: torch.device,
    chunk_tokens: int,
    with_entropy: bool,
    *,
    backend: str = "ours",
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Decoder over a micro-batch's packed rows, then the chunked head at the kept positions:
    (`logprobs_P`, `entropy_P` or None, `link`).

    With a varlen attention (FlashAttention, or our exact `packed_sdpa` on CPU) the samples go in
    as one unpadded row; otherwise as padded rows with a block-diagonal causal mask, in the form
    the model's attention takes (`MicroBatch.attention_mask`). `link` is a zero that depends on
    every parameter the forward used, so that a backward reaches each FSDP unit even when no
    token of the batch is kept."""
    dtype = getattr(model, "dtype", torch.float32)
    inputs, keep_P = batch.decoder_inputs(model.config._attn_implementation, device, dtype)
    hidden = model.get_decoder()(**inputs, use_cache=False).last_hidden_state
    hidden_N_H = hidden.reshape(-1, hidden.shape[-1])
    head = output_head(model)
    targets_P = batch.targets_P.to(device)
    logprobs_P, entropy_P = token_logprobs(
        hidden_N_H[keep_P],
        head,
        targets_P,
        chunk_tokens=chunk_tokens,
        with_entropy=with_entropy,
        backend=backend,
    )
    if keep_P.numel() > 0:
        link = logprobs_P.sum() * 0.0
    else:
        first, _ = token_logprobs(hidden_N_H[:1], head, targets_P.new_zeros(1))
        link = first.sum() * 0.0
    return logprobs_P, entropy_P, link


def _forward_only(
    hidden_N_H: torch.Tensor,
    head: nn.Module,
    targets_N: torch.Tensor,
    chunk_tokens: int,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs (and entropy) when no backward is needed through a plain linear head, or with
    a checkpointed graph through any other head. One head matmul per chunk either way."""
    logprobs: list[torch.Tensor] = []
    entropies: list[torch.Tensor] = []
    for start in range(0, hidden_N_H.shape[0], chunk_tokens):
        hidden = hidden_N_H[start : start + chunk_tokens]
        targets = targets_N[start : start + chunk_tokens]
        if torch.is_grad_enabled():
            lp, _ = checkpoint(_chunk_logprobs, head, hidden, targets, use_reentrant=False)
            logprobs.append(lp)
            if with_entropy:
                with torch.no_grad():
                    _, chunk_entropy = _no_grad_chunk(head, hidden, targets, True)
                assert chunk_entropy is not None
                entropies.append(chunk_entropy)
            continue
        lp, entropy = _no_grad_chunk(head, hidden, targets, with_entropy)
        logprobs.append(lp)
        if entropy is not None:
            entropies.append(entropy)
    entropy_N = torch.cat(entropies) if with_entropy else None
    return torch.cat(logprobs), entropy_N


def _no_grad_chunk(
    head: nn.Module, hidden_C_H: torch.Tensor, targets_C: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    logits_C_V = head(hidden_C_H.detach()).float()
    target_C = _pick(logits_C_V, targets_C)
    max_C = logits_C_V.amax(dim=-1)
    max_C = torch.where(torch.isfinite(max_C), max_C, torch.zeros_like(max_C))
    exp_C_V = (logits_C_V - max_C[:, None]).exp_()
    sum_C = exp_C_V.sum(-1)
    lse_C = max_C + sum_C.log()
    entropy_C = None
    if with_entropy:
        entropy_C = lse_C - exp_C_V.mul_(logits_C_V).sum(-1) / sum_C
    return target_C - _rows(lse_C, target_C), entropy_C


def liger_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("liger_kernel") is not None


def _use_liger(backend: str, head: nn.Module, hidden_N_H: torch.Tensor) -> bool:
    if backend not in ("ours", "liger"):
        raise ValueError(f"unknown logprobs backend {backend!r} (ours, liger)")
    return (
        backend == "liger"
        and hidden_N_H.device.type == "cuda"
        and type(head) is nn.Linear
        and liger_available()
    )


def liger_token_logprobs(
    hidden_N_H: torch.Tensor,
    weight_V_H: torch.Tensor,
    bias_V: torch.Tensor | None,
    targets_N: torch.Tensor,
) -> torch.Tensor:
    """liger-kernel's fused linear cross entropy, `reduction="none"`: `lp = −CE` per token.

    With per-token losses liger defers its gradients to the backward and folds the incoming
    per-token gradient into each row, so any loss of the logprobs backpropagates exactly
    (liger-kernel ≥ 0.8). CUDA only (Triton).
    """
    from liger_kernel.ops.fused_linear_cross_entropy import (
        LigerFusedLinearCrossEntropyFunction,
    )

    out = LigerFusedLinearCrossEntropyFunction.apply(
        hidden_N_H, weight_V_H, targets_N, bias_V, None, -100, 0.0, 0.0, "none"
    )
    loss_N = out[0] if isinstance(out, tuple) else out
    return -loss_N.float()


def naive_token_logprobs(
    hidden_N_H: torch.Tensor, head: nn.Module, targets_N: torch.Tensor
) -> torch.Tensor:
    """Reference: full fp32 `[N, V]` logits at once, `[N]` or `[N, K]` targets. For tests and
    benchmarks only."""
    logits_N_V = head(hidden_N_H).float()
    return _pick(torch.log_softmax(logits_N_V, dim=-1), targets_N)
