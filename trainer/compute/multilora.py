"""Segment-wise multi-adapter LoRA: one forward/backward over the tokens of several adapters.

Design notes: `docs/design/batching.md`.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class Segment:
    adapter: str | None  # a peft adapter name of the model; None: base model only (zero delta)
    start: int  # [start, end) over the FLATTENED token positions of the layer input:
    end: int  # x.reshape(-1, hidden) -- a packed row [1, N, H] or padded rows [B, T, H]


@dataclass(frozen=True)
class _Run:
    adapter: str
    start: int
    end: int


_MISSING = object()


def lora_layers(peft_model: Any) -> list[Any]:
    """Every peft LoRA layer (`LoraLayer`) of `peft_model`, in module order."""
    from peft.tuners.lora.layer import LoraLayer

    return [m for m in _walk(peft_model) if isinstance(m, LoraLayer)]


def _walk(root: nn.Module) -> Iterator[nn.Module]:
    """`root.modules()` in the same order, without entering LoRA layers (their adapters'
    modules: thousands with many sessions, walked at every decode step otherwise)."""
    from peft.tuners.lora.layer import LoraLayer

    stack, seen = [root], set()
    while stack:
        module = stack.pop()
        if id(module) in seen:  # a module shared by two parents: once, as `modules()` does
            continue
        seen.add(id(module))
        yield module
        if not isinstance(module, LoraLayer):
            children = [child for child in module._modules.values() if child is not None]
            stack.extend(reversed(children))


def runs_of(segments: Sequence[Segment]) -> list[_Run]:
    """Check `segments` and return the runs that carry an adapter, in the order given:
    segments of one adapter next to each other in the list and in positions are merged, None
    segments dropped."""
    spans = []
    for seg in segments:
        if not isinstance(seg, Segment):
            raise ValueError(f"segments: expected Segment, got {type(seg).__name__}")
        if seg.start < 0 or seg.end < seg.start:
            raise ValueError(f"segments: bad range [{seg.start}, {seg.end})")
        if seg.end > seg.start:
            spans.append(seg)
    ordered = sorted(spans, key=lambda s: s.start)
    for prev, cur in itertools.pairwise(ordered):
        if cur.start < prev.end:
            raise ValueError(
                f"segments overlap: [{prev.start}, {prev.end}) and [{cur.start}, {cur.end})"
            )
    runs: list[_Run] = []
    for seg in spans:
        if seg.adapter is None:
            continue
        last = runs[-1] if runs else None
        if last is not None and last.adapter == seg.adapter and last.end == seg.start:
            runs[-1] = _Run(seg.adapter, last.start, seg.end)
        else:
            runs.append(_Run(seg.adapter, seg.start, seg.end))
    return runs


@contextlib.contextmanager
def segmented(
    peft_model: Any,
    segments: Sequence[Segment],
    *,
    generators: Mapping[str, torch.Generator] | None = None,
) -> Iterator[None]:
    """While active, every peft LoRA layer of `peft_model` computes, for the positions of each
    segment, base(x) + lora_B_a(lora_A_a(dropout_a(x_seg))) * scaling_a with that segment's
    adapter a only (an adapter absent from a layer, or None: base only). Positions outside every
    segment get base(x). Train and eval mode alike; gradients reach each adapter's lora_A/lora_B
    only from its own positions. Segments must not overlap. Outside the context, peft's own
    behaviour (the active adapter) is untouched. `generators`: per-adapter dropout RNG (module
    docstring)."""
    runs = runs_of(segments)
    limit = max((seg.end for seg in segments), default=0)
    from peft.tuners.lora.layer import LoraLayer

    layers: list[Any] = []
    checkpointed: list[tuple[Any, Any]] = []
    for module in _walk(peft_model):
        if isinstance(module, LoraLayer):
            layers.append(module)
        # Layers checkpointed by transformers recompute their forward during backward, which may
        # run after this context is gone: their checkpoint function is wrapped so that the
        # recompute runs under these same forwards.
        if "_gradient_checkpointing_func" in module.__dict__:
            checkpointed.append((module, module.__dict__["_gradient_checkpointing_func"]))
    _check(layers, runs)
    gens = dict(generators or {})
    forwards = [
        (layer, _make_forward(layer, [r for r in runs if r.adapter in layer.lora_A], limit, gens))
        for layer in layers
    ]
    saved = _install(forwards)
    try:
        for module, func in checkpointed:
            module._gradient_checkpointing_func = _pinning(func, forwards, gens)
        yield
    finally:
        for module, func in checkpointed:
            module._gradient_checkpointing_func = func
        _restore(saved)


Installed = list[tuple[nn.Module, Any]]


def _install(forwards: Installed) -> Installed:
    """Set each layer's instance `forward`; return what was there (`_MISSING`: nothing)."""
    saved = [(layer, layer.__dict__.get("forward", _MISSING)) for layer, _ in forwards]
    for layer, forward in forwards:
        layer.forward = forward
    return saved


def _restore(saved: Installed) -> None:
    for layer, previous in saved:
        if previous is _MISSING:
            layer.__dict__.pop("forward", None)
        else:
            layer.forward = previous


def _pinning(checkpoint_func: Any, forwards: Installed, generators: dict[str, Any]) -> Any:
    """`checkpoint_func(fn, *args)` whose `fn` (first run and recompute alike) runs with
    `forwards` installed. The checkpoint replays the global RNG, not `generators`: a recompute
    replays them from their state at the first run, then leaves them where they were."""

    def pinned_checkpoint(fn: Any, *args: Any, **kwargs: Any) -> Any:
        first: dict[str, torch.Tensor] = {}

        def run(*inner: Any, **inner_kwargs: Any) -> Any:
            replay = bool(first)
            now = {name: g.get_state() for name, g in generators.items()}
            if replay:
                for name, g in generators.items():
                    g.set_state(first[name])
            else:
                first.update(now)
            saved = _install(forwards)
            try:
                return fn(*inner, **inner_kwargs)
            finally:
                _restore(saved)
                if replay:
                    for name, g in generators.items():
                        g.set_state(now[name])

        return checkpoint_func(run, *args, **kwargs)

    return pinned_checkpoint


def _check(layers: list[Any], runs: list[_Run]) -> None:
    from peft.tuners.lora.layer import Linear

    adapters = {run.adapter for run in runs}
    known = set().union(*(layer.lora_A.keys() for layer in layers)) if layers else set()
    unknown = sorted(adapters - known)
    if unknown:
        raise ValueError(f"segments: no LoRA layer holds adapter(s) {unknown}")
    for layer in layers:
        if layer.merged:
            raise ValueError("segmented LoRA: merged adapters are not supported")
        if layer.disable_adapters:
            raise ValueError("segmented LoRA: adapters are disabled")
        held = adapters & set(layer.lora_A.keys())
        if not held:
            continue
        if not isinstance(layer, Linear):
            raise ValueError(
                f"segmented LoRA: {type(layer).__name__} layers are not supported "
                f"(adapters {sorted(held)})"
            )
        variants = sorted(held & set(getattr(layer, "lora_variant", {})))
        dora = sorted(a for a in held if layer.use_dora.get(a, False))
        if variants or dora:
            raise ValueError(
                f"segmented LoRA: LoRA variants (DoRA, ...) are not supported "
                f"(adapters {sorted(set(variants) | set(dora))})"
            )


def _make_forward(
    layer: Any, plan: list[_Run], limit: int, generators: dict[str, torch.Generator]
) -> Any:
    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.pop("adapter_names", None) is not None:
            raise ValueError("segmented LoRA: adapter_names= is not supported inside segmented()")
        kwargs.pop("alora_offsets", None)
        positions = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if limit > positions:
            raise ValueError(f"segments reach position {limit}, but the input has {positions}")
        result = layer.base_layer(x, *args, **kwargs)  # first, as peft does (same graph order)
        if not plan:
            return result
        result_dtype = result.dtype
        flat_x = x.reshape(positions, x.shape[-1])
        deltas: dict[int, torch.Tensor] = {}
        for run in plan:  # in the segments' order: the order of the dropout draws
            lora_A = layer.lora_A[run.adapter]
            lora_B = layer.lora_B[run.adapter]
            x_seg = layer._cast_input_dtype(flat_x[run.start : run.end], lora_A.weight.dtype)
            dropout = layer.lora_dropout[run.adapter]
            if not isinstance(dropout, nn.Identity):
                x_seg = _dropout(dropout, x_seg, generators.get(run.adapter))
            delta = lora_B(lora_A(x_seg)) * layer.scaling[run.adapter]
            deltas[run.start] = delta.to(result_dtype)
        return result + _assemble(deltas, positions, result).view(result.shape)

    return forward


def _assemble(deltas: dict[int, torch.Tensor], positions: int, like: torch.Tensor) -> torch.Tensor:
    """The `[positions, out]` delta: each run's rows at its start, zeros elsewhere. One `cat`
    (its backward only slices), not in-place adds into the output (whose backward would copy
    the whole `[positions, out]` gradient once per run: the head's `[N, vocab]`)."""
    pieces, at = [], 0
    for start in sorted(deltas):
        delta = deltas[start]
        if start > at:
            pieces.append(like.new_zeros(start - at, delta.shape[-1]))
        pieces.append(delta)
        at = start + delta.shape[0]
    if at < positions:
        pieces.append(like.new_zeros(positions - at, pieces[-1].shape[-1]))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _dropout(module: nn.Module, x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    if generator is None or not isinstance(module, nn.Dropout):
        return module(x)
    p = float(module.p)
    if not module.training or p == 0.0:
        return x
    if p >= 1.0:
        return x * torch.zeros_like(x)
    noise = torch.empty_like(x).bernoulli_(1 - p, generator=generator)
    noise.div_(1 - p)
    return x * noise
