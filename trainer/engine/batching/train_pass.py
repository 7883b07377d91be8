"""The forward(-backward) pass: one function, `run_pass`, for the calls of 1..N sessions of a
resource. A solo call is a pass of one call.

Design notes: `docs/design/batching.md`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from trainer.compute import optim
from trainer.compute.batch import LossNorm, MicroBatch
from trainer.compute.losses import LossInputs, LossOutputs
from trainer.compute.rounds import (
    add_metrics,
    call_result,
    collect_outputs,
    split_by_tokens,
    sum_reports,
)
from trainer.contract.errors import OperationError
from trainer.engine.batching.pass_forward import Forward, JointForward, PlainForward
from trainer.engine.batching.work import LossFn, WorkItem
from trainer.engine.faults import fault_point

if TYPE_CHECKING:
    from trainer.compute.placement import Communicator


def run_pass(items: list[WorkItem]) -> None:
    """Run the items (all forward-only, or all forward-backward; distinct sessions of one
    resource) as one pass under the resource lock; each item gets its result or its error.
    Under torchrun every rank calls this with the same items (each on its own replicas)."""
    resource = items[0].session.resource
    comm = resource.comm
    forward_only = items[0].forward_only
    with resource.lock:
        live = _live(items)
        if not live:
            return
        for item in live:
            item.local = split_by_tokens(item.prepared, comm.world_size)[comm.rank]
        try:
            forward: Forward = PlainForward(live[0]) if len(live) == 1 else JointForward(live)
            with forward.scope():
                if not forward_only:
                    for item in live:
                        item.stash = item.session.stash_grads()
                try:
                    _rounds(live, forward, comm)
                finally:
                    if forward_only:
                        resource.placement.reshard()
                _settle(live, comm, forward_only)
                forward.settled()
            _finish(live)
        except BaseException as exc:
            for item in live:
                if item.stash is not None:
                    item.session.restore_grads(item.stash)
                    item.stash = None
                item.fail(exc)


def _live(items: list[WorkItem]) -> list[WorkItem]:
    live = []
    for item in items:
        if item.session.active:
            live.append(item)
        else:
            sid = item.session.id
            item.fail(OperationError("SESSION_NOT_ACTIVE", f"session {sid} is not running"))
    return live


def _rounds(live: list[WorkItem], forward: Forward, comm: Communicator) -> None:
    """Every rank runs as many rounds as the busiest one and no rank raises mid-call: a call's
    first failure is kept, every rank runs the same collectives, and the reports decide."""
    forward_only = live[0].forward_only
    for i in range(forward.rounds):
        if comm.world_size == 1 and any(item.failure is not None for item in live):
            break  # alone, nobody waits on our collectives: fail at once
        fault_point("micro_batch")
        with torch.set_grad_enabled(not forward_only):
            logprobs, entropies, link = forward.run(i)
            _losses(live, logprobs, entropies)
            if not forward_only:
                _backward(live, link)
                for item in live:
                    item.session.widen_grads()


def _losses(
    live: list[WorkItem],
    logprobs: list[torch.Tensor | None],
    entropies: list[torch.Tensor | None],
) -> None:
    """Each item's loss on its own logprobs of this round, with its call-level norm."""
    for item, logprobs_P, entropy_P in zip(live, logprobs, entropies, strict=True):
        item.out = None
        if logprobs_P is None or item.batch is None:
            continue  # no sample of this call in this round on this rank
        out, failure = loss_of(item.fn, item.batch, logprobs_P, item.norm)
        item.out, item.failure = out, item.failure or failure
        if out is not None:
            item.loss += float(out.loss.detach())
            add_metrics(item.sums, out.metrics)
        if entropy_P is not None and any(s.keep_all for s in item.batch.samples):
            entropy_P = entropy_P[item.batch.mask_P().to(entropy_P.device) != 0]
        add_metrics(item.sums, {}, entropy_P)
        if item.return_outputs:
            collect_outputs(item.batch, logprobs_P.detach().float().cpu(), item.outputs)


def _backward(live: list[WorkItem], link: torch.Tensor | None) -> None:
    """One backward over this round's finite losses and the `link` (a zero that reaches every
    parameter the forward used, where the forward gives one)."""
    losses = [item.out.loss for item in live if item.out is not None]
    if link is not None:
        losses.append(link)
    if losses:
        total = losses[0]
        for loss in losses[1:]:
            total = total + loss
        if total.requires_grad:
            total.backward()


def _settle(live: list[WorkItem], comm: Communicator, forward_only: bool) -> None:
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
            optim.sum_replicated_grads(list(item.session.policy.trainable.values()), comm)
    for item in live:  # every check first: nothing is kept until all are decided
        if item.failure is None:
            try:
                item.session.check_new_grads()
            except OperationError as exc:
                item.failure = [exc.code, exc.message]
    for item in live:
        assert item.stash is not None
        if item.failure is not None:
            item.session.restore_grads(item.stash)
        else:
            item.session.keep_grads(item.stash, item.prepared)
        item.stash = None


def _finish(live: list[WorkItem]) -> None:
    for item in live:
        if item.failure is not None:
            item.fail(OperationError(*item.failure))
            continue
        total, sums, outputs = sum_reports(item.reports)
        item.result = call_result(total, sums, outputs if item.return_outputs else None, item.norm)


def loss_of(
    fn: LossFn, batch: MicroBatch, logprobs_P: torch.Tensor, norm: LossNorm
) -> tuple[LossOutputs | None, list[str] | None]:
    """A micro-batch's loss, or None and why it failed."""
    try:
        out = fn(_loss_inputs(batch, logprobs_P, norm), batch)
    except ValueError as exc:
        return None, ["INVALID_INPUT", str(exc)]
    if not torch.isfinite(out.loss):
        return None, ["NON_FINITE_LOSS", f"the loss is not finite ({out.loss})"]
    return out, None


def _loss_inputs(batch: MicroBatch, logprobs_P: torch.Tensor, norm: LossNorm) -> LossInputs:
    device = logprobs_P.device

    def get(name: str) -> torch.Tensor | None:
        value = batch.gather(name)
        return None if value is None else value.to(device)

    return LossInputs(
        logprobs_P=logprobs_P,
        sample_index_P=batch.sample_index_P.to(device),
        num_samples=len(batch.samples),
        mask_P=batch.mask_P().to(device),
        norm=norm,
        weights_P=get("weights"),
        sampler_logprobs_P=get("logprobs"),
        advantages_P=get("advantages"),
        reference_logprobs_P=get("reference_logprobs"),
    )
