"""How a pass (`train_pass.run_pass`) runs the model: `PlainForward` for one call,
`JointForward` for the calls of several LoRA sessions.

Design notes: `docs/design/batching.md`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from trainer.compute.architecture import ROWS, layout_of, output_head
from trainer.compute.batch import MicroBatch, PreparedSample, build_micro_batch, pack, pack_rows
from trainer.compute.logprobs import batch_logprobs, token_logprobs
from trainer.compute.moe_replay import replaying
from trainer.compute.multilora import Segment, segmented
from trainer.compute.policy import train_only
from trainer.compute.rounds import empty_batch
from trainer.contract.errors import OperationError

if TYPE_CHECKING:
    from trainer.engine.batching.work import WorkItem

Tensors = list[torch.Tensor | None]
Round = tuple[Tensors, Tensors, torch.Tensor | None]
"""Per call: the logprobs and entropy of its kept tokens in this round (None: no sample of
it here); and the round's `link`, a zero that reaches every parameter the forward used."""


class Forward(Protocol):
    """How a pass runs the model over its calls, round after round."""

    @property
    def rounds(self) -> int:
        """How many rounds every rank runs (the busiest rank's)."""

    def scope(self) -> contextlib.AbstractContextManager[None]:
        """Around the pass: the adapters active and trainable, train or eval mode."""

    def run(self, round: int) -> Round:
        """One round's forward; sets each call's `batch` for the round."""

    def settled(self) -> None:
        """After the reports and the gradient checks, inside `scope`."""


class PlainForward:
    """One call, through the model as it is (the module docstring)."""

    def __init__(self, item: WorkItem) -> None:
        self.item = item
        session = item.session
        options = session.options
        one_per_row = layout_of(session.policy.model) == ROWS
        self.batches = (
            pack(
                item.local,
                row_tokens=options.row_tokens,
                token_budget=options.token_budget,
                one_per_row=one_per_row,
            )
            if item.local
            else []
        )
        self.rounds = session.comm.max_int(len(self.batches))

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        session = self.item.session
        with session.operation_scope(), session.policy.training(train=not self.item.forward_only):
            yield

    def run(self, round: int) -> Round:
        item = self.item
        session, options = item.session, item.session.options
        real = round < len(self.batches)
        batch = self.batches[round] if real else empty_batch()
        model = session.policy.model
        with replaying(model, batch):  # a keyed sample's recorded experts
            logprobs_P, entropy_P, link = cast(
                tuple[torch.Tensor, torch.Tensor | None, torch.Tensor],
                session.resource.placement.run(
                    model,
                    batch_logprobs,
                    batch,
                    session.device,
                    options.chunk_tokens,
                    item.forward_only,
                    backend=options.logprob_backend,
                ),
            )
        item.batch = batch if real else None
        return [logprobs_P if real else None], [entropy_P if real else None], link

    def settled(self) -> None:
        """A failed call raises inside its session's operation scope, which then puts back the
        RNG state the call started with, as for any failed operation."""
        if self.item.failure is not None:
            raise OperationError(*self.item.failure)


class JointForward:
    """The calls of several LoRA sessions in one micro-batch (the module docstring)."""

    rounds = 1

    def __init__(self, live: list[WorkItem]) -> None:
        self.live = live
        peft = live[0].session.policy.peft
        adapters = [item.session.policy.adapter for item in live]
        if peft is None or any(adapter is None for adapter in adapters):
            raise ValueError("a shared pass runs LoRA sessions only")
        self.peft = peft
        self.adapters = [str(adapter) for adapter in adapters]

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        forward_only = self.live[0].forward_only
        train_only(self.peft, set(self.adapters))
        self.peft.train(not forward_only)
        if not forward_only:  # eval mode draws nothing
            for item in self.live:
                config = item.session.policy.config
                if config is not None and float(config.dropout) > 0:
                    item.rng = torch.Generator().set_state(item.session.cpu_rng)
        try:
            yield
        finally:
            self.peft.eval()

    def run(self, round: int) -> Round:
        session = self.live[0].session
        model = session.policy.model
        world_size = session.comm.world_size
        placement = session.resource.placement
        found = placement.run(model, _joint, self.live, self.adapters, self.peft, world_size)
        return cast(Round, found)

    def settled(self) -> None:
        """Each completed call's session continues its stream from where its draws left it."""
        for item in self.live:
            if item.failure is None and item.rng is not None:
                item.session.cpu_rng = item.rng.get_state()


def joint_batch(
    items: list[WorkItem], row_tokens: int, attn: str | None, one_per_row: bool = False
) -> tuple[MicroBatch, list[tuple[int, int]]]:
    """All items' rows in one micro-batch, item after item, and each item's `[start, end)`
    over the flattened positions of the decoder's input (`[1, Σ tokens]` with a varlen
    attention, else the padded `[rows, width]`; `one_per_row`: the `ROWS` layout). Sample indices
    are made unique across items, in item order, so the kept positions come item after item, each
    item's in its own solo order. The batch places positions only: each item's head reads its own
    targets (`_joint`), so here every sample carries one column of them ([T, K] soft targets and [T]
    ones side by side).
    """
    rows: list[list[PreparedSample]] = []
    spans: list[tuple[int, int]] = []  # row range per item
    offset = 0
    for item in items:
        samples = item.local or [_masked_token()]
        relabeled = [
            replace(s, index=offset + s.index, targets_T=s.targets_T.reshape(s.length, -1)[:, 0])
            for s in samples
        ]
        offset += 1 + max(s.index for s in samples)
        first = len(rows)
        rows.extend(pack_rows(relabeled, row_tokens, one_per_row))
        spans.append((first, len(rows)))
    batch = build_micro_batch(rows, one_per_row)
    width = int(batch.tokens_R_L.shape[1])
    varlen = batch.varlen(attn)
    starts = [0]
    for length in batch.row_lengths:
        starts.append(starts[-1] + (length if varlen else width))
    return batch, [(starts[a], starts[b]) for a, b in spans]


def _masked_token() -> PreparedSample:
    """A rank's stand-in for a call with no sample here: one token, no loss, no output."""
    one = torch.zeros(1, dtype=torch.long)
    return PreparedSample(index=0, tokens_T=one, targets_T=one, mask_T=torch.zeros(1))


@contextlib.contextmanager
def head_adapter(head: torch.nn.Module, adapter: str) -> Iterator[None]:
    """The output head computes with `adapter` only (a peft LoRA head; a plain head: no-op),
    without touching which parameters require gradients."""
    if not hasattr(head, "_active_adapter"):
        yield
        return
    layer: Any = head
    saved = layer._active_adapter
    layer._active_adapter = [adapter]
    try:
        yield
    finally:
        layer._active_adapter = saved


@contextlib.contextmanager
def _global_rng(generator: torch.Generator | None) -> Iterator[None]:
    """The global CPU RNG continues `generator`'s stream (a LoRA head's dropout draws from the
    global RNG, as in a solo call), and `generator` continues from where it left off."""
    if generator is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(generator.get_state())
        try:
            yield
        finally:
            generator.set_state(torch.get_rng_state())


def _joint(
    model: Any, live: list[WorkItem], adapters: list[str], peft: torch.nn.Module, world_size: int
) -> Round:
    """Inside the placement: the decoder once over every item's rows, then the head per item
    with its adapter. Per item: logprobs and entropy of its kept tokens here (None: no sample
    here); and, under torchrun, the zero `link` over every item's positions."""
    session = live[0].session
    options = session.options
    device = session.device
    forward_only = live[0].forward_only
    attn = model.config._attn_implementation
    one_per_row = layout_of(model) == ROWS
    batch, spans = joint_batch(live, options.row_tokens, attn, one_per_row)
    dtype = getattr(model, "dtype", torch.float32)
    inputs, keep_P = batch.decoder_inputs(attn, device, dtype)
    segments = [Segment(adapter, a, b) for adapter, (a, b) in zip(adapters, spans, strict=True)]
    generators = {a: item.rng for a, item in zip(adapters, live) if item.rng is not None}
    with segmented(peft, segments, generators=generators):
        hidden = model.get_decoder()(**inputs, use_cache=False).last_hidden_state
    hidden_N_H = hidden.reshape(-1, hidden.shape[-1])
    lm_head = model.get_output_embeddings()
    head = output_head(model)
    start = 0
    logprobs: Tensors = []
    entropies: Tensors = []
    links: list[torch.Tensor] = []
    for item, adapter, (first, _) in zip(live, adapters, spans, strict=True):
        logprobs_P = entropy_P = None
        item.batch = None
        with head_adapter(lm_head, adapter), _global_rng(item.rng):
            if item.local:
                solo = pack(
                    item.local,
                    row_tokens=options.row_tokens,
                    token_budget=1 << 62,  # one batch: its kept positions, in solo order
                    one_per_row=one_per_row,
                )
                item.batch = solo[0]
                kept = int(item.batch.keep_index_P.shape[0])
                index = keep_P[start : start + kept]
                start += kept
                logprobs_P, entropy_P = token_logprobs(
                    hidden_N_H[index],
                    head,
                    item.batch.targets_P.to(device),
                    chunk_tokens=options.chunk_tokens,
                    with_entropy=forward_only,
                    backend=options.logprob_backend,
                )
            if world_size > 1 and torch.is_grad_enabled():
                links.append(_link(logprobs_P, hidden_N_H[first : first + 1], head, device))
        logprobs.append(logprobs_P)
        entropies.append(entropy_P)
    link = None
    for part in links:
        link = part if link is None else link + part
    return logprobs, entropies, link


def _link(
    logprobs_P: torch.Tensor | None,
    first_H: torch.Tensor,
    head: torch.nn.Module,
    device: torch.device,
) -> torch.Tensor:
    """A zero that depends on the item's head (and decoder) parameters: its logprobs, or, when
    it keeps no token here, one position's, as `batch_logprobs` does for such a batch."""
    if logprobs_P is not None and logprobs_P.numel() > 0:
        return logprobs_P.sum() * 0.0
    zero = torch.zeros(1, dtype=torch.long, device=device)
    one, _ = token_logprobs(first_H, head, zero)
    return one.sum() * 0.0
