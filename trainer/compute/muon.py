"""Muon with its auxiliary AdamW (docs/semantics.md §10), for one rank or many.

Design notes: `docs/design/compute.md`.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _adjust_lr

from trainer.compute.optim import (
    HALF,
    MASTER,
    MasterAdamW,
    all_or_nothing,
    clip_global,
    new_adamw,
    scale_grads_,
    set_adam_knobs,
    step_grads,
)
from trainer.contract.muon_params import MuonParams
from trainer.contract.optimizer import ADJUST_LR_FN

if TYPE_CHECKING:
    from trainer.compute.placement import Communicator

_IN_DECODER_LAYER = re.compile(r"(^|\.)layers\.\d+\.")
_HEAD_OR_EMBEDDING = re.compile(r"(^|\.)(lm_head|embed_tokens|embed_out|wte|wpe)(\.|$)")


def muon_split(names_and_shapes: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Rule 10's split of trainable tensors (name -> tensor or shape): (Muon's, AdamW's), each
    in the given order. A 3-D tensor inside a decoder layer is a stack of expert matrices."""
    muon: list[str] = []
    adam: list[str] = []
    for name, value in names_and_shapes.items():
        shape = value.shape if hasattr(value, "shape") else tuple(value)
        inside = _IN_DECODER_LAYER.search(name) and not _HEAD_OR_EMBEDDING.search(name)
        (muon if inside and len(shape) in (2, 3) else adam).append(name)
    return muon, adam


# How Muon sees one tensor: None (one matrix), ("stack",) for (experts, out, in), or
# ("lora_A", experts) / ("lora_B", experts) for ParamWrapper's LoRA factors.
Layout = tuple[Any, ...] | None


def layout_of(name: str, shape: Any, expert_factors: dict[str, int] | None = None) -> Layout:
    experts = (expert_factors or {}).get(name)
    if experts:
        return ("lora_B" if ".lora_B." in name else "lora_A", experts)
    return ("stack",) if len(tuple(shape)) == 3 else None


def expert_view(tensor: torch.Tensor, layout: Layout) -> torch.Tensor:
    """`tensor` as (experts, m, n), a view sharing its storage (one matrix: experts = 1)."""
    if layout is None:
        return tensor.unsqueeze(0)
    if layout[0] == "stack":
        return tensor
    experts = layout[1]
    if layout[0] == "lora_A":  # (experts·r, in) -> (experts, r, in)
        return tensor.view(experts, -1, tensor.shape[-1])
    return tensor.view(tensor.shape[0], -1, experts).permute(2, 0, 1)  # (experts, out, r)


def orthogonalise(update: torch.Tensor, layout: Layout, steps: int) -> torch.Tensor:
    """Newton–Schulz of each expert's matrix of `update` (a full tensor), laid out as it."""
    if layout is None:
        return newton_schulz(update, steps)
    out = torch.empty_like(update)
    target, source = expert_view(out, layout), expert_view(update.contiguous(), layout)
    for e in range(source.shape[0]):
        target[e].copy_(newton_schulz(source[e], steps))
    return out


def newton_schulz(update: torch.Tensor, steps: int) -> torch.Tensor:
    """`torch.optim._muon._zeropower_via_newtonschulz` line for line, in fp32 rather than bf16
    (§10 allows both): bf16 misses §10's 3e-2 bound on LoRA's thin matrices, whose
    small singular values the iteration amplifies (docs/decisions.md)."""
    a, b, c = DEFAULT_A, DEFAULT_B, DEFAULT_C
    x = update.float()
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=EPS)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.T if tall else x).to(update.dtype)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _like(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """`full` laid out like `param`: this rank's shard of it (every rank holds `full` alike)."""
    if isinstance(param, DTensor):
        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    return full


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon on `muon` (2-D matrices), AdamW on `adam`; one state, one `step`."""

    def __init__(
        self,
        muon: list[nn.Parameter],
        adam: list[nn.Parameter],
        scaling_strategy: str,
        layouts: list[Layout] | None = None,
        masters: bool = True,
    ) -> None:
        groups: list[dict[str, Any]] = [
            {
                "params": muon,
                "kind": "muon",
                "lr": 1e-4,
                "momentum": 0.95,
                "weight_decay": 0.0,
                "ns_steps": 5,
                "adjust_lr_fn": ADJUST_LR_FN[scaling_strategy],
            }
        ]
        super().__init__(groups, {})
        self.layouts: dict[nn.Parameter, Layout] = {}
        for param, layout in zip(muon, layouts or [None] * len(muon), strict=True):
            if param.ndim != (3 if layout == ("stack",) else 2):
                raise ValueError(f"Muon updates 2-D matrices, not a tensor of shape {param.shape}")
            self.layouts[param] = layout
        self.masters = masters
        # with masters, the 16-bit weights' gradients add up in fp32 (`optim.accumulate_`)
        self.wide_grads: dict[nn.Parameter, torch.Tensor] | None = {} if masters else None
        self.adamw = new_adamw(adam, masters) if adam else None  # its fp32 masters, if any
        if self.adamw is not None:
            self.adamw.state = self.state  # one state for both sides (disjoint parameters)
            if isinstance(self.adamw, MasterAdamW) and self.wide_grads is not None:
                self.adamw.wide_grads = self.wide_grads  # and one set of sums

    def set_knobs(self, muon: MuonParams) -> None:
        self.param_groups[0].update(
            lr=muon.learning_rate,
            momentum=muon.momentum,
            weight_decay=muon.weight_decay,
            ns_steps=muon.newton_schulz_steps,
        )
        if self.adamw is not None:
            set_adam_knobs(self.adamw, muon.adam)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        group = self.param_groups[0]
        lr, mu, decay = group["lr"], group["momentum"], group["weight_decay"]
        wide = self.wide_grads or {}
        for param in group["params"]:
            grad = wide.get(param, param.grad)
            if grad is None:
                continue
            state = self.state[param]
            # a 16-bit matrix steps its fp32 master (slot `master`, as `optim.MasterAdamW`)
            # with the gradient and the momentum in fp32, then takes the master rounded
            master = None
            if self.masters and param.dtype in HALF:
                master = state.get(MASTER)
                if master is None:
                    master = param.detach().float()
            grad = grad if master is None else grad.float()
            buf = state.get("momentum_buffer")
            if buf is None or buf.dtype != grad.dtype:  # new, or saved without masters
                buf = torch.zeros_like(grad) if buf is None else buf.to(grad.dtype)
            state["momentum_buffer"] = buf
            buf.lerp_(grad, 1 - mu)
            layout = self.layouts.get(param)
            update = orthogonalise(_full(grad.lerp(buf, mu)), layout, group["ns_steps"])
            shape = expert_view(update, layout).shape[1:]  # one expert's matrix
            target = param if master is None else master
            target.mul_(1 - lr * decay)
            target.add_(_like(param, update), alpha=-_adjust_lr(lr, group["adjust_lr_fn"], shape))
            if master is not None:
                state[MASTER] = master
                param.copy_(master)
        if self.adamw is not None:
            self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        if self.adamw is not None:
            self.adamw.zero_grad(set_to_none)
        if self.wide_grads is not None:
            self.wide_grads.clear()


def new_muon(
    trainable: dict[str, nn.Parameter],
    scaling_strategy: str,
    expert_factors: dict[str, int] | None = None,
    masters: bool = True,
) -> MuonWithAdamW:
    """`expert_factors`: a LoRA policy's (canonical name -> experts) of its expert factors.
    `masters`: 16-bit weights step through fp32 masters, on the AdamW side
    (`optim.MasterAdamW`) and on the Muon side (`MuonWithAdamW.step`) alike."""
    muon, adam = muon_split(trainable)
    layouts = [layout_of(n, trainable[n].shape, expert_factors) for n in muon]
    return MuonWithAdamW(
        [trainable[n] for n in muon],
        [trainable[n] for n in adam],
        scaling_strategy,
        layouts,
        masters,
    )


def muon_step(
    optimizer: MuonWithAdamW,
    params: list[nn.Parameter],
    muon: MuonParams,
    comm: Communicator,
    grad_scale: float = 1.0,
) -> dict[str, float]:
    """The gradients times `grad_scale` (`optim.adamw_step`), one global clip over every
    tensor (`muon_params.grad_clip_norm`), then Muon and AdamW with this call's knobs, then
    zero gradients. NON_FINITE_LOSS, and nothing moves, when the norm or the update is not
    finite (`all_or_nothing`)."""
    with all_or_nothing(optimizer, params, comm):
        grads = step_grads(optimizer, params)
        scale_grads_(grads, grad_scale)
        norm = clip_global(grads, muon.grad_clip_norm, comm)
        clipped = min(norm, muon.grad_clip_norm) if muon.grad_clip_norm > 0 else norm
        optimizer.set_knobs(muon)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {
        "grad_norm": norm,
        "grad_norm_clipped": clipped,
        "learning_rate": muon.learning_rate,
        "adam_learning_rate": muon.adam.learning_rate,
    }
