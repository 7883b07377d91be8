"""A session's optimizer: AdamW with per-call parameters, the global gradient norm and its
clipping, and the finite checks, written once for one rank or many.

Gradients are plain tensors (replicated: one process, or LoRA adapters under FSDP) or DTensor
shards (full weights under FSDP). The global norm is
`sqrt(Σ over ranks of the shards' squares + the replicated norm²)`: the shards' squares are
summed in fp64 through the communicator (an identity in one process), and the replicated norm
is `torch.nn.utils.get_total_norm`, so one process computes exactly what torch does.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from trainer.compute.policy import layout_like
from trainer.contract.errors import OperationError
from trainer.contract.specs import AdamParams

if TYPE_CHECKING:
    from trainer.compute.placement import Communicator


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a DTensor; a plain tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


HALF = (torch.bfloat16, torch.float16)
MASTER = "master"  # the optimizer-state slot of a 16-bit weight's fp32 master copy


class MasterAdamW(torch.optim.AdamW):
    """`torch.optim.AdamW` that steps 16-bit weights through fp32 master copies.

    A bf16 weight cannot take an update much below 2**-9 of itself (an AdamW step moves it by
    about the learning rate, so at 1e-5 most weights of a full-weight bf16 model would never
    move, nor decay). Each 16-bit weight therefore keeps an fp32 copy in its optimizer state
    (slot `master`, made from the weight at its first step, saved and restored with the rest of
    the state); torch's AdamW steps the masters, with the gradients in fp32 and fp32 moments,
    and the weights become the masters rounded to their dtype. FSDP2 shards (DTensors) keep
    sharded masters. fp32 weights (the CPU, LoRA adapters) step exactly as `torch.optim.AdamW`.

    The 16-bit weights' gradients add up in fp32 too: `wide_grads` holds each one's fp32 sum
    since the last step (`accumulate_` moves each backward's `.grad` into it), which the step
    takes in place of `.grad` and `zero_grad` clears.
    """

    def __init__(self, params: list[nn.Parameter], **knobs: Any) -> None:
        super().__init__(params, **knobs)
        self.wide_grads: dict[nn.Parameter, torch.Tensor] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.wide_grads.clear()

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        grads = {}
        for group in self.param_groups:
            for p in group["params"]:
                grad = self.wide_grads.get(p, p.grad)
                if grad is not None and p.dtype in HALF:
                    grads[p] = grad
        if not grads:
            super().step()
            return
        own = {p: p.grad for p in grads if p.grad is not None}  # off for the plain step below
        # the 16-bit weights' masters stand in for them in an AdamW of the same groups, whose
        # state is the weights' own state (one dict each: moments and step land there)
        steps: list[tuple[nn.Parameter, nn.Parameter, dict]] = []
        try:  # every master taken out of its state below goes back in, whatever fails
            groups = []
            for group in self.param_groups:
                stand_ins = []
                for param in group["params"]:
                    if param not in grads:
                        continue
                    state = self.state[param]
                    master = state.pop(MASTER, None)
                    stand_in = nn.Parameter(param.detach().float() if master is None else master)
                    steps.append((param, stand_in, state))
                    stand_in.grad = grads[param].float()
                    stand_ins.append(stand_in)
                if stand_ins:
                    groups.append(
                        {**{k: v for k, v in group.items() if k != "params"}, "params": stand_ins}
                    )
            for param in own:
                param.grad = None  # the plain step below leaves them to the masters'
            super().step()
            masters = torch.optim.AdamW(groups)
            for _, stand_in, state in steps:
                masters.state[stand_in] = state
            masters.step()
            for param, stand_in, _ in steps:
                param.detach().copy_(stand_in.detach())
        finally:
            for _, stand_in, state in steps:
                state[MASTER] = stand_in.detach()
            for param, grad in own.items():
                param.grad = grad


def wide_grads(optimizer: torch.optim.Optimizer) -> dict[nn.Parameter, torch.Tensor] | None:
    """The optimizer's fp32 gradient sums of 16-bit weights (`MasterAdamW`, and Muon with
    masters), or None where it keeps none (`master_weights = false`)."""
    wide: dict[nn.Parameter, torch.Tensor] | None = getattr(optimizer, "wide_grads", None)
    return wide


def accumulate_(optimizer: torch.optim.Optimizer, params: Iterable[nn.Parameter]) -> None:
    """Move each 16-bit weight's `.grad` (a backward's gradient) into the optimizer's fp32 sum
    of it, where the optimizer keeps one: sums over micro-batches and calls are not rounded to
    16 bits."""
    wide = wide_grads(optimizer)
    if wide is None:
        return
    with torch.no_grad():
        for param in params:
            if param.grad is not None and param.dtype in HALF:
                total = wide.get(param)
                wide[param] = param.grad.float() if total is None else total.add_(param.grad)
                param.grad = None


def step_grads(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> list[torch.Tensor]:
    """The gradients a step takes: each weight's fp32 sum where the optimizer keeps one, else
    its `.grad`."""
    wide = wide_grads(optimizer) or {}
    grads = [wide.get(p, p.grad) for p in params]
    return [g for g in grads if g is not None]


def new_adamw(params: list[nn.Parameter], masters: bool = True) -> torch.optim.AdamW:
    """The session's AdamW (with `masters`, fp32 masters for 16-bit weights: `MasterAdamW`);
    every knob is set again by each step (`adamw_step`)."""
    kind = MasterAdamW if masters else torch.optim.AdamW
    return kind(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8)


def grad_norm(grads: list[torch.Tensor], comm: Communicator) -> float:
    """The global L2 norm of the gradients, wherever their parts live. Collective."""
    replicated = [g for g in grads if not isinstance(g, DTensor)]
    sharded = [local_part(g) for g in grads if isinstance(g, DTensor)]
    squares = torch.zeros(1, dtype=torch.float64, device=comm.device)
    for part in sharded:
        squares += part.to(squares.device, torch.float64).pow(2).sum()
    comm.sum_(squares)
    if replicated:
        norm = torch.nn.utils.get_total_norm(replicated).to(squares.device, torch.float64)
        squares += norm.pow(2)
    return float(squares.sqrt())


def check_finite_grads(grads: list[torch.Tensor], comm: Communicator) -> None:
    """NON_FINITE_LOSS unless every rank's `grads` (a call's new gradients) are finite.
    Collective."""
    if not torch.isfinite(torch.tensor(grad_norm(grads, comm))):
        raise OperationError("NON_FINITE_LOSS", "the gradient is not finite")


def clip_grads_(grads: list[torch.Tensor], max_norm: float, norm: float) -> None:
    """`torch.nn.utils.clip_grads_with_norm_` on each rank's part of the gradients."""
    coef = torch.clamp(max_norm / (torch.tensor(norm) + 1e-6), max=1.0)
    with torch.no_grad():
        for grad in grads:
            part = local_part(grad)
            part.mul_(coef.to(part.device))


def sum_replicated_grads(params: list[nn.Parameter], comm: Communicator) -> None:
    """Sum the replicated parameters' gradients over ranks, in one buffer (FSDP reduces the
    shards' own). A parameter no rank's backward reached keeps no gradient, as in one process
    (an embedding call never reaches the head's adapter; a zero would give it AdamW state).
    Nothing to do in one process. Collective: one all-reduce, whose last entries count the
    ranks that reached each parameter."""
    replicated = [p for p in params if not isinstance(p, DTensor)]
    if comm.world_size == 1 or not replicated:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in replicated]
    reached = torch.tensor([float(p.grad is not None) for p in replicated], dtype=grads[0].dtype)
    flat = torch.cat([*(g.reshape(-1) for g in grads), reached.to(grads[0].device)])
    flat = comm.sum_(flat)
    counts = flat[-len(replicated) :].tolist()
    offset = 0
    for param, count in zip(replicated, counts, strict=True):
        n = param.numel()
        if count > 0:
            param.grad = flat[offset : offset + n].view_as(param).clone()
        offset += n


def clip_global(grads: list[torch.Tensor], max_norm: float, comm: Communicator) -> float:
    """The global norm over every tensor's gradient, then the clip to `max_norm` (0: none).
    NON_FINITE_LOSS, before any weight moves, when the norm is not finite. Collective."""
    norm = grad_norm(grads, comm)
    if not torch.isfinite(torch.tensor(norm)):
        raise OperationError("NON_FINITE_LOSS", f"the gradient norm is {norm}")
    if max_norm > 0 and grads:
        clip_grads_(grads, max_norm, norm)
    return norm


def scale_grads_(grads: list[torch.Tensor], scale: float) -> None:
    """Multiply each rank's part of the gradients by `scale` (1: untouched, bit for bit)."""
    if scale == 1.0:
        return
    with torch.no_grad():
        for grad in grads:
            local_part(grad).mul_(scale)


def set_adam_knobs(optimizer: torch.optim.Optimizer, adam: AdamParams) -> None:
    for group in optimizer.param_groups:
        group.update(
            lr=adam.learning_rate,
            betas=(adam.beta1, adam.beta2),
            eps=adam.eps,
            weight_decay=adam.weight_decay,
        )


class _Saved:
    """Copies of this rank's part of the weights, gradients and optimizer state of a step."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
        self.optimizer, self.params = optimizer, params
        with torch.no_grad():
            self.weights = [local_part(p.detach()).clone() for p in params]
            self.grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
            self.wide = wide_grads(optimizer)
            self.wide_sums = {p: g.detach().clone() for p, g in (self.wide or {}).items()}
            self.state = {
                p: {
                    k: v.clone() if torch.is_tensor(v) else v for k, v in optimizer.state[p].items()
                }
                for p in params
                if p in optimizer.state
            }

    def restore(self) -> None:
        with torch.no_grad():
            for param, weights, grad in zip(self.params, self.weights, self.grads, strict=True):
                local_part(param.detach()).copy_(weights)
                param.grad = grad
            if self.wide is not None:
                self.wide.clear()
                self.wide.update(self.wide_sums)
            for param in self.params:
                if param in self.state:
                    self.optimizer.state[param] = self.state[param]
                else:
                    self.optimizer.state.pop(param, None)

    def all_finite(self, comm: Communicator) -> bool:
        """Whether every rank's updated weights and optimizer state are finite. Collective."""
        tensors = [local_part(p.detach()) for p in self.params]
        for param in self.params:
            values = self.optimizer.state.get(param, {}).values()
            tensors += [local_part(v) for v in values if torch.is_tensor(v)]
        # reduced on each tensor's device and summed there: one host read, not one per tensor
        flags: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
        for tensor in tensors:
            if tensor.is_floating_point():
                flags[tensor.device].append(torch.isfinite(tensor).all())
        bad = torch.zeros(1, dtype=torch.float64, device=comm.device)
        for found in flags.values():
            bad += (~torch.stack(found)).sum().to(bad.device, torch.float64)
        return float(comm.sum_(bad)) == 0


@contextlib.contextmanager
def all_or_nothing(
    optimizer: torch.optim.Optimizer, params: list[nn.Parameter], comm: Communicator
) -> Iterator[None]:
    """An optimizer step that is kept only when it raises nothing and leaves every weight and
    optimizer state tensor finite; otherwise the weights, gradients and state go back to what
    they were (NON_FINITE_LOSS for a non-finite update). Costs one copy of each. Collective."""
    saved = _Saved(optimizer, params)
    try:
        yield
        finite = saved.all_finite(comm)
    except BaseException:
        saved.restore()
        raise
    if not finite:
        saved.restore()
        raise OperationError(
            "NON_FINITE_LOSS",
            "the update would leave the weights or the optimizer state not finite "
            "(the learning rate or weight decay is too large for them): the step was undone",
        )


def adamw_step(
    optimizer: torch.optim.Optimizer,
    params: list[nn.Parameter],
    adam: AdamParams,
    comm: Communicator,
    grad_scale: float = 1.0,
) -> dict[str, float]:
    """The gradients times `grad_scale` (the accumulation's normalization, docs/semantics.md
    §23), global-norm clipping, then AdamW (decoupled decay) with this call's knobs, then zero
    gradients. NON_FINITE_LOSS, and nothing moves (the gradients unscaled), when the norm or
    the update is not finite (`all_or_nothing`)."""
    with all_or_nothing(optimizer, params, comm):
        grads = step_grads(optimizer, params)
        scale_grads_(grads, grad_scale)
        norm = clip_global(grads, adam.grad_clip_norm, comm)
        clipped = min(norm, adam.grad_clip_norm) if adam.grad_clip_norm > 0 else norm
        set_adam_knobs(optimizer, adam)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"grad_norm": norm, "grad_norm_clipped": clipped, "learning_rate": adam.learning_rate}


def state_tensors(
    optimizer: torch.optim.Optimizer, trainable: dict[str, nn.Parameter], copy: bool = True
) -> dict[str, torch.Tensor]:
    """The optimizer state under `name::slot` keys: CPU copies, or (`copy=False`) the live
    tensors (DTensors stay DTensors), to be read under the resource lock."""
    out = {}
    for name, param in trainable.items():
        for slot, value in optimizer.state.get(param, {}).items():
            value = value.detach()
            out[f"{name}::{slot}"] = value.to("cpu", copy=True) if copy else value
    return out


def load_state_tensors(
    optimizer: torch.optim.Optimizer,
    trainable: dict[str, nn.Parameter],
    tensors: dict[str, torch.Tensor],
) -> None:
    """Install `name::slot` tensors (full, or already laid out like their parameter)."""
    by_param: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for key, value in tensors.items():
        name, _, slot = key.rpartition("::")
        if name not in trainable:
            raise ValueError(f"optimizer state names an unknown tensor {name}")
        by_param[name][slot] = value
    for name, state in by_param.items():
        param = trainable[name]
        optimizer.state[param] = {
            slot: (v if slot == "step" else layout_like(param, v, cast=False))
            for slot, v in state.items()
        }
