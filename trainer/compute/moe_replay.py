"""Mixture-of-experts routing: recorded at sampling, forced at training (docs/semantics.md §12).

Design notes: `docs/design/compute.md`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

# Routers whose combine rule is "softmax over all experts, top-k, renormalised when
# norm_topk_prob": replay reproduces exactly that rule at forced ids.
ROUTER_CLASSES = ("Qwen3MoeTopKRouter",)

_MISSING = object()


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's MoE routers in layer order (empty: a dense model)."""
    return [m for m in model.modules() if type(m).__name__ in ROUTER_CLASSES]


def routing_shape(model: nn.Module) -> tuple[int, int] | None:
    """(MoE layers, experts per token), or None for a dense model."""
    found = routers(model)
    if not found:
        return None
    top_k: Any = found[0].top_k
    return len(found), int(top_k)


def expert_count(model: nn.Module) -> int:
    """How many experts each router chooses from (0: a dense model)."""
    found = routers(model)
    weight: Any = found[0].weight if found else None
    return 0 if weight is None else int(weight.shape[0])


# -- recording -------------------------------------------------------------------------------


class Recorder:
    """The expert ids of one generation's model calls (`rows` rows, left-padded to `width`)."""

    def __init__(self, model: nn.Module, rows: int) -> None:
        self.routers = routers(model)
        self.rows = rows
        self.armed = True
        self.calls: list[list[torch.Tensor]] = [[] for _ in self.routers]

    @contextlib.contextmanager
    def hooked(self) -> Iterator[Recorder]:
        handles = [
            router.register_forward_hook(self._hook(i)) for i, router in enumerate(self.routers)
        ]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def _hook(self, layer: int) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            if self.armed:
                self.calls[layer].append(output[2].detach().to(torch.int16))  # no sync

        return hook

    def pausing(self, give_turn: Callable[[], None] | None) -> Callable[[], None] | None:
        """`give_turn` with recording off while other operations run."""
        if give_turn is None:
            return None
        inner = give_turn

        def paused() -> None:
            self.armed = False
            try:
                inner()
            finally:
                self.armed = True

        return paused

    def per_row(self, prompts: list[list[int]], completions: list[int]) -> list[torch.Tensor]:
        """Each row's routes `[positions, layers, k]` (int16): its prompt and its completion but
        the last token. `prompts[r]` and `completions[r]` (token counts) per row, in row order."""
        width = max(len(p) for p in prompts)
        layers = []
        for calls in self.calls:
            per_call = [ids.reshape(self.rows, -1, ids.shape[-1]) for ids in calls]
            layers.append(torch.cat(per_call, dim=1))
        stacked = torch.stack(layers, dim=2).cpu()  # [rows, calls' positions, layers, k]
        out = []
        for r, (prompt, made) in enumerate(zip(prompts, completions, strict=True)):
            start = width - len(prompt)
            out.append(stacked[r, start : width + max(made - 1, 0)].clone())
        return out


def pausing(
    recorder: Recorder | None, give_turn: Callable[[], None] | None
) -> Callable[[], None] | None:
    """`give_turn` with `recorder` (if any) off while other operations run."""
    return give_turn if recorder is None else recorder.pausing(give_turn)


def recording(model: nn.Module, rows: int, wanted: bool) -> contextlib.AbstractContextManager[Any]:
    """A `Recorder` hooked on `model`'s routers for one generation, or None (as the context's
    value) when routes are not wanted or the model is dense."""
    if not wanted or not routers(model):
        return contextlib.nullcontext(None)
    return Recorder(model, rows).hooked()


def assign(
    recorder: Recorder,
    prompts: list[list[list[int]]],
    groups: list[list[list[Any]]],
    wanted: list[bool],
) -> None:
    """Each generated sequence's expert ids onto it (`Sequence.routed_experts`), for the calls
    that asked.
    Per call (one, or each job of a batched generation): its prompts and its sequences grouped
    by prompt, in the generation's row order (call, then prompt, then sample)."""
    recorder.armed = False  # later calls (prompt logprobs) are not the generation's
    rows_prompts: list[list[int]] = []
    sequences: list[Any] = []
    wants: list[bool] = []
    for call_prompts, call_groups, want in zip(prompts, groups, wanted, strict=True):
        for prompt, group in zip(call_prompts, call_groups, strict=True):
            for seq in group:
                rows_prompts.append(prompt)
                sequences.append(seq)
                wants.append(want)
    made = [len(seq.tokens) for seq in sequences]
    for seq, routes, want in zip(sequences, recorder.per_row(rows_prompts, made), wants):
        if want:
            seq.routed_experts = routes


# -- replay ----------------------------------------------------------------------------------


def _forced_forward(router: nn.Module, forced_N_K: torch.Tensor, use_N: torch.Tensor) -> Any:
    """The router's forward with the rows `use_N` sent to `forced_N_K`."""
    original = type(router).forward
    norm = bool(getattr(router, "norm_topk_prob", False))

    def forward(hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits, scores, own = original(router, hidden_states)
        if logits.shape[0] != use_N.shape[0]:
            raise RuntimeError(
                f"routing replay: {logits.shape[0]} routed positions, plan for {use_N.shape[0]}"
            )
        forced = forced_N_K.to(own.device)
        use = use_N.to(own.device)
        index = torch.where(use[:, None], forced, own)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        weights = probs.gather(-1, index)
        if norm:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = torch.where(use[:, None], weights.to(scores.dtype), scores)
        return logits, weights, index

    return forward


def plan(batch: Any, attn_implementation: str | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A micro-batch's forced routes in the decoder's flattened token order: `[N, layers, k]`
    expert ids and `[N]` whether each position is forced; None when no sample carries routes.
    A sample's route row of negative ids (an empty routing matrix) leaves that position to the
    router's own choice.

    The order is `MicroBatch.decoder_inputs`': padded rows `[R*L]`, or (varlen attention) the
    real tokens of the rows end to end. Each sample's routes go to its own positions
    (`segment_R_L == sample.index`), wherever it was packed."""
    carried = [s for s in batch.samples if s.routed_experts is not None]
    if not carried:
        return None
    segment = batch.segment_R_L
    flat = segment[segment >= 0] if batch.varlen(attn_implementation) else segment.reshape(-1)
    shape = carried[0].routed_experts.shape[1:]
    forced = torch.zeros((flat.shape[0], *shape), dtype=torch.long)
    use = torch.zeros(flat.shape[0], dtype=torch.bool)
    for sample in carried:
        recorded = sample.routed_experts
        positions = torch.nonzero(flat == sample.index).squeeze(-1)[: recorded.shape[0]]
        rows = recorded[: positions.shape[0]].long()
        forced[positions] = rows.clamp(min=0)
        use[positions] = (rows >= 0).flatten(1).all(-1)
    return forced, use


@contextlib.contextmanager
def replaying(model: nn.Module, batch: Any) -> Iterator[None]:
    """`model`'s routers forced to the recorded routes of `batch`'s samples (module
    docstring); nothing changes when none carries routes. Callers hold the compute lock."""
    found = plan(batch, getattr(model.config, "_attn_implementation", None))
    if found is None:
        yield
        return
    forced, use = found
    layers = routers(model)
    if forced.shape[1] != len(layers):
        raise RuntimeError("routing replay: routes for another number of MoE layers")
    forwards = [(r, _forced_forward(r, forced[:, i], use)) for i, r in enumerate(layers)]
    checkpointed = [
        (m, m.__dict__["_gradient_checkpointing_func"])
        for m in model.modules()
        if "_gradient_checkpointing_func" in m.__dict__
    ]
    saved = _install(forwards)
    try:
        for module, func in checkpointed:
            module._gradient_checkpointing_func = _pinning(func, forwards)  # type: ignore[assignment]
        yield
    finally:
        for module, func in checkpointed:
            module._gradient_checkpointing_func = func  # type: ignore[assignment]
        _restore(saved)


def _install(forwards: list[tuple[nn.Module, Any]]) -> list[tuple[nn.Module, Any]]:
    saved = [(module, module.__dict__.get("forward", _MISSING)) for module, _ in forwards]
    for module, forward in forwards:
        module.forward = forward
    return saved


def _restore(saved: list[tuple[nn.Module, Any]]) -> None:
    for module, previous in saved:
        if previous is _MISSING:
            module.__dict__.pop("forward", None)
        else:
            module.forward = previous


def _pinning(checkpoint_func: Any, forwards: list[tuple[nn.Module, Any]]) -> Any:
    """`checkpoint_func(fn, ...)` whose `fn` runs with the forced forwards, first run and
    recompute alike (the recompute may come after `replaying` has exited)."""

    def pinned(fn: Any, *args: Any, **kwargs: Any) -> Any:
        def run(*inner: Any, **inner_kwargs: Any) -> Any:
            saved = _install(forwards)
            try:
                return fn(*inner, **inner_kwargs)
            finally:
                _restore(saved)

        return checkpoint_func(run, *args, **kwargs)

    return pinned
