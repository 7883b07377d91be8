"""One forward(-backward) over the calls of several LoRA sessions of a resource.

Each call (a `WorkItem`) keeps its own samples, loss, call-level norm (Part B rule 2) and
result; the decoder runs once over all of them, packed so that each call's rows are contiguous,
with `trainer.compute.multilora.segmented` giving each call's positions its own session's adapter.
The
output head runs per call with that call's adapter (as in a solo call), then each call's loss is
computed on its own logprobs, exactly as `TrainingSession._run_batches` does for one
micro-batch. One backward runs over the sum of the finite losses.

Atomic per call: a call whose loss is not finite (or whose loss refuses its input) is left out
of the backward and fails; after the backward each call's new gradients are checked apart, and
a call with non-finite ones gets its accumulated gradients back and fails. The others complete.
A failure of the pass itself fails every call in it and restores every call's gradients.

Each session's RNG stream: a session with LoRA dropout draws its masks from its own CPU RNG
state (`segmented(generators=...)` in the decoder, the global RNG set to it around its head),
in the order a solo call draws them, and keeps the state it ends in only when its call
completes. On CPU with a varlen attention (one packed row per call) these are the solo masks
bit for bit, which is where the scheduler allows merging a session with dropout.

Any world size (one engine path): each rank runs its share of each call's samples
(`split_by_tokens`, as a solo call does), the decoder and head run through the placement (the
FSDP root under torchrun), the per-call reports are exchanged in one collective and each
call's failure is global, and each call's replicated LoRA gradients are summed over ranks
before its finite check. Under torchrun every call of the pass takes part on every rank (a
rank holding none of its samples runs one masked token with its adapter), and a zero `link`
over every call's positions joins the backward, so that every rank's backward reaches the
same FSDP units. In one process these are identities.

Used only where a scheduler allows it: `trainer/engine/batching/pass_scheduler.py` in one process,
`trainer/distributed/batching.py` under torchrun (LoRA, no dropout in the model's own config,
each call fits in one micro-batch).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from trainer.compute import optim
from trainer.compute.attention import is_varlen
from trainer.compute.batch import LossNorm, MicroBatch, PreparedSample, _build, pack, pack_rows
from trainer.compute.logprobs import token_logprobs
from trainer.compute.losses import LossInputs, LossOutputs
from trainer.compute.rounds import (
    add_metrics,
    call_result,
    collect_outputs,
    merge_reports,
    new_sums,
    split_by_tokens,
)
from trainer.contract.errors import OperationError

if TYPE_CHECKING:
    from trainer.engine.session import TrainingSession

LossFn = Callable[[LossInputs, MicroBatch], LossOutputs]


@dataclass
class WorkItem:
    """One session's forward(-backward) call, waiting for (then holding) its outcome."""

    session: TrainingSession
    prepared: list[PreparedSample]
    fn: LossFn
    norm: LossNorm
    forward_only: bool
    return_outputs: bool
    result: dict[str, Any] | None = None
    error: BaseException | None = None
    done: bool = False
    taken: bool = False  # in a group being run (`trainer.engine.batching.combine`)
    # filled during the pass
    batch: MicroBatch | None = None
    stash: dict[str, torch.Tensor | None] | None = None
    out: LossOutputs | None = None
    failure: list[str] | None = None
    sums: Any = field(default_factory=new_sums)
    outputs: dict[int, list[float]] = field(default_factory=dict)
    loss: float = 0.0
    rng: torch.Generator | None = None  # the session's CPU stream, for its dropout draws
    local: list[PreparedSample] = field(default_factory=list)  # this rank's share
    reports: list[dict[str, Any]] = field(default_factory=list)  # every rank's, after the pass

    @property
    def tokens(self) -> int:
        return sum(s.length for s in self.prepared)

    @property
    def dropout(self) -> float:
        config = self.session.policy.config
        return 0.0 if config is None else float(config.dropout)

    @property
    def adapter(self) -> str:
        return self.session.policy.adapter or ""

    def fail(self, error: BaseException) -> None:
        if self.error is None and self.result is None:
            self.error = error


def merged_batch(
    items: list[WorkItem], row_tokens: int, varlen: bool
) -> tuple[MicroBatch, list[tuple[int, int]]]:
    """All items' rows in one micro-batch, item after item, and each item's `[start, end)`
    over the flattened positions of the decoder's input (`[1, Σ tokens]` when `varlen`, else
    the padded `[rows, width]`). Sample indices are made unique across items, in item order,
    so the kept positions come item after item, each item's in its own solo order."""
    rows: list[list[PreparedSample]] = []
    spans: list[tuple[int, int]] = []  # row range per item
    offset = 0
    for item in items:
        samples = item.local or [_masked_token()]
        relabeled = [replace(s, index=offset + s.index) for s in samples]
        offset += 1 + max(s.index for s in samples)
        first = len(rows)
        rows.extend(pack_rows(relabeled, row_tokens))
        spans.append((first, len(rows)))
    batch = _build(rows)
    width = int(batch.tokens_R_L.shape[1])
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


def _require_grads(peft: Any, adapters: set[str]) -> None:
    """Exactly these adapters' LoRA weights take gradients (as `LoraPolicy._activate` does
    for one)."""
    for module in peft.modules():
        if hasattr(module, "lora_A"):
            for key in module.lora_A:
                module.lora_A[key].requires_grad_(key in adapters)
                module.lora_B[key].requires_grad_(key in adapters)


def run_merged(items: list[WorkItem]) -> None:
    """Run the items (all forward-only, or all forward-backward; distinct sessions of one
    resource) as one pass under the resource lock; each item gets its result or its error.
    Under torchrun every rank calls this with the same items (each on its own replicas)."""
    from trainer.compute.multilora import Segment, segmented

    resource = items[0].session.resource
    comm = resource.comm
    forward_only = items[0].forward_only
    with resource.lock:
        live = []
        for item in items:
            if item.session.active:
                live.append(item)
            else:
                sid = item.session.id
                item.fail(OperationError("SESSION_NOT_ACTIVE", f"session {sid} is not running"))
        if not live:
            return
        for item in live:
            item.local = split_by_tokens(item.prepared, comm.world_size)[comm.rank]
        peft = live[0].session.policy.peft
        assert peft is not None  # merged passes hold LoRA sessions only
        try:
            if not forward_only:
                for item in live:
                    item.stash = item.session._stash_grads()
            _require_grads(peft, {item.adapter for item in live})
            peft.train(not forward_only)
            try:
                with torch.set_grad_enabled(not forward_only):
                    model = live[0].session.policy.model
                    seg = (Segment, segmented, peft)
                    found = resource.placement.run(model, _forward, live, seg, comm.world_size)
                    logprobs, entropies, link = found
                    _losses(live, logprobs, entropies)
                    if not forward_only:
                        _backward(live, link)
            finally:
                peft.eval()
                if forward_only:
                    resource.placement.reshard()
            _settle(live, comm, forward_only)
            _finish(live)
        except BaseException as exc:
            for item in live:
                if item.stash is not None:
                    item.session._restore_grads(item.stash)
                    item.stash = None
                item.fail(exc)


def _forward(
    model: Any, live: list[WorkItem], seg: tuple[Any, Any, Any], world_size: int
) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None], torch.Tensor | None]:
    """Inside the placement: the decoder once over every item's rows, then the head per item
    with its adapter. Per item: logprobs and entropy of its kept tokens here (None: no sample
    here); and, under torchrun, the zero `link` over every item's positions."""
    segment_cls, segmented, peft = seg
    session = live[0].session
    options = session.options
    device = session.device
    forward_only = live[0].forward_only
    attn = model.config._attn_implementation
    batch, spans = merged_batch(live, options.row_tokens, is_varlen(attn))
    dtype = getattr(model, "dtype", torch.float32)
    inputs, keep_P = batch.decoder_inputs(attn, device, dtype)
    segments = [segment_cls(item.adapter, a, b) for item, (a, b) in zip(live, spans)]
    if not forward_only:  # eval mode draws nothing
        for item in live:
            if item.dropout > 0:
                item.rng = torch.Generator().set_state(item.session._cpu_rng)
    generators = {item.adapter: item.rng for item in live if item.rng is not None}
    with segmented(peft, segments, generators=generators):
        hidden = model.get_decoder()(**inputs, use_cache=False).last_hidden_state
    hidden_N_H = hidden.reshape(-1, hidden.shape[-1])
    head = model.get_output_embeddings()
    start = 0
    logprobs: list[torch.Tensor | None] = []
    entropies: list[torch.Tensor | None] = []
    links: list[torch.Tensor] = []
    for item, (first, _) in zip(live, spans):
        logprobs_P = entropy_P = None
        with head_adapter(head, item.adapter), _global_rng(item.rng):
            if item.local:
                solo = pack(item.local, row_tokens=options.row_tokens, token_budget=item.tokens)
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
                if logprobs_P is not None and logprobs_P.numel() > 0:
                    links.append(logprobs_P.sum() * 0.0)
                else:  # as `batch_logprobs` does for a batch that keeps no token
                    zero = torch.zeros(1, dtype=torch.long, device=device)
                    one, _ = token_logprobs(hidden_N_H[first : first + 1], head, zero)
                    links.append(one.sum() * 0.0)
        logprobs.append(logprobs_P)
        entropies.append(entropy_P)
    link = None
    for part in links:
        link = part if link is None else link + part
    return logprobs, entropies, link


def _losses(
    live: list[WorkItem],
    logprobs: list[torch.Tensor | None],
    entropies: list[torch.Tensor | None],
) -> None:
    """Each item's loss on its own logprobs, with its call-level norm (as a solo call)."""
    for item, logprobs_P, entropy_P in zip(live, logprobs, entropies):
        if logprobs_P is None or item.batch is None:
            continue  # no sample of this call on this rank
        out, failure = item.session._loss(item.fn, item.batch, logprobs_P, item.norm, None)
        item.out, item.failure = out, failure
        if out is not None:
            item.loss = float(out.loss.detach())
            add_metrics(item.sums, out.metrics)
        if entropy_P is not None and any(s.keep_all for s in item.batch.samples):
            entropy_P = entropy_P[item.batch.mask_P().to(entropy_P.device) != 0]
        add_metrics(item.sums, {}, entropy_P)
        if item.return_outputs:
            collect_outputs(item.batch, logprobs_P.detach().float().cpu(), item.outputs)


def _backward(live: list[WorkItem], link: torch.Tensor | None) -> None:
    """One backward over the finite losses (and the `link`, under torchrun)."""
    losses = [item.out.loss for item in live if item.out is not None and item.failure is None]
    if link is not None:
        losses.append(link)
    if losses:
        total = losses[0]
        for loss in losses[1:]:
            total = total + loss
        if total.requires_grad:
            total.backward()


def _settle(live: list[WorkItem], comm: Any, forward_only: bool) -> None:
    """Every rank's report of every item (one exchange): an item fails where any rank's part
    of it failed. Then each remaining item's new gradients are summed over ranks and checked
    apart, and kept (added to its accumulated ones) or dropped."""
    mine = [
        {"loss": item.loss, "sums": item.sums, "outputs": item.outputs, "failure": item.failure}
        for item in live
    ]
    ranks = comm.all_gather_json(mine)
    for k, item in enumerate(live):
        item.reports = [reports[k] for reports in ranks]
        failures = [r["failure"] for r in item.reports if r["failure"] is not None]
        item.failure = failures[0] if failures else None
    if forward_only:
        return
    for item in live:
        if item.failure is None:
            params = list(item.session.policy.trainable.values())
            optim.sum_replicated_grads(params, comm)
    for item in live:  # every check first: nothing is kept until all are decided
        if item.failure is None:
            try:
                item.session._check_new_grads()
            except OperationError as exc:
                item.failure = [exc.code, exc.message]
    for item in live:
        assert item.stash is not None
        if item.failure is not None:
            item.session._restore_grads(item.stash)
        else:
            item.session._merge_grads(item.stash)
        item.stash = None


def _finish(live: list[WorkItem]) -> None:
    for item in live:
        if item.failure is not None:
            item.fail(OperationError(*item.failure))
            continue
        if item.rng is not None:  # kept only when the call completes, as `operation_scope` does
            item.session._cpu_rng = item.rng.get_state()
        total, sums, outputs = merge_reports(item.reports)
        item.result = call_result(total, sums, outputs if item.return_outputs else None, item.norm)
