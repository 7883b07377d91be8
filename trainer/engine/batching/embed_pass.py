"""An embedding call (docs/semantics.md §27): the samples' pooled hidden states, and a forward's
outputs or a backward of the objective over them. It runs alone, in its session's operation
scope, and keeps its new gradients exactly as a forward-backward pass does (`train_pass`).

An objective that couples the samples (a similarity matrix, InfoNCE) needs every sample's
vector before any gradient. When the call is one micro-batch, the backward runs through it
directly. Otherwise the call runs twice: a forward without gradients gives all vectors `P`;
the objective's gradient `C = df/dP` is taken on them; then each micro-batch's forward again,
with the same dropout draws, backpropagates `Σ_i C_i · P_i`, which has the same gradient.

Under torchrun every rank takes its share of the samples (`split_by_tokens`) and runs as many
rounds as the busiest rank, a rank with none left running the decoder on one masked token so
every FSDP unit sees every round. The vectors meet by one all-reduce (each rank's rows in
place, zeros elsewhere), so every rank computes the objective and `C` alike, and always by the
two passes; the replicated LoRA gradients are summed over ranks after the backward, as a
forward-backward pass sums them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from trainer.compute import optim
from trainer.compute.architecture import ROWS, layout_of
from trainer.compute.batch import MicroBatch, PreparedSample, pack
from trainer.compute.embeddings import (
    batch_embeddings,
    decoder_states,
    objective_value,
    outputs,
)
from trainer.compute.policy import cuda_devices
from trainer.compute.rounds import empty_batch, split_by_tokens
from trainer.contract.arrays import as_float32
from trainer.contract.embeddings import EmbeddingObjective, check_embedding_call
from trainer.contract.errors import OperationError
from trainer.contract.rules import Limits, token_values
from trainer.contract.specs import Gradient, Sample
from trainer.engine.batching.work import PassSession


def embedding_call(
    session: PassSession,
    limits: Limits,
    hidden_size: int,
    samples: list[Sample],
    objective: EmbeddingObjective,
    forward_only: bool,
    gradients: list[Gradient] | None,
) -> dict[str, Any]:
    """`{"outputs": [[float]] | None, "metrics": {...}}`; see the module docstring. `limits`:
    the model's, with its vocabulary; `hidden_size`: its hidden state's width."""
    check_embedding_call(samples, objective, forward_only, gradients, limits, hidden_size)
    prepared = [_prepared(i, sample) for i, sample in enumerate(samples)]
    grads = _gradients(gradients)
    comm, options = session.comm, session.options
    local = split_by_tokens(prepared, comm.world_size)[comm.rank]  # all of them, alone
    batches = (
        pack(
            local,
            row_tokens=options.row_tokens,
            token_budget=options.token_budget,
            one_per_row=layout_of(session.policy.model) == ROWS,
        )
        if local
        else []
    )
    rounds = comm.max_int(len(batches))
    call = _Call(session, batches, rounds, len(samples), hidden_size, objective)
    with session.operation_scope(), session.policy.training(train=not forward_only):
        if forward_only:
            try:
                with torch.no_grad():
                    return _forward_result(call.vectors(), objective, grads)
            finally:
                session.resource.placement.reshard()
        stash = session.stash_grads()
        try:
            metrics = _backward(call, grads)
            optim.sum_replicated_grads(list(session.policy.trainable.values()), comm)
            session.check_new_grads()
        except BaseException:
            session.restore_grads(stash)
            raise
        session.keep_grads(stash, ())  # no loss tokens or sequences: the counts stay (§27)
    return {"outputs": None, "metrics": metrics}


def _prepared(index: int, sample: Sample) -> PreparedSample:
    tokens = torch.as_tensor(np.asarray(token_values(sample.model_input), dtype=np.int64))
    return PreparedSample(
        index=index,
        tokens_T=tokens,
        targets_T=torch.zeros_like(tokens),
        mask_T=torch.ones(len(tokens)),
        keep_all=True,  # every position is pooled
    )


def _gradients(gradients: list[Gradient] | None) -> torch.Tensor | None:
    """The client's gradients (checked) as `[N, H]` (`embedding`) or `[N, N]` fp32."""
    if gradients is None:
        return None
    return torch.stack([torch.from_numpy(as_float32(np.asarray(g.data))) for g in gradients])


def _order(batch: MicroBatch) -> torch.Tensor:
    return torch.tensor([s.index for s in batch.samples], dtype=torch.long)


@dataclass
class _Call:
    """One call's micro-batches on this rank, and the rounds every rank runs."""

    session: PassSession
    batches: list[MicroBatch]
    rounds: int
    count: int  # samples in the whole call
    width: int  # the hidden state's
    objective: EmbeddingObjective

    def round(self, i: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Round `i` here: (its samples' indices in the call, their vectors `[n, H]`); past
        this rank's micro-batches, (None, a zero reaching every parameter the decoder used)."""
        session = self.session
        run = session.resource.placement.run
        if i < len(self.batches):
            batch = self.batches[i]
            pooling = self.objective.pooling
            found = run(session.policy.model, batch_embeddings, batch, session.device, pooling)
            assert isinstance(found, torch.Tensor)
            return _order(batch).to(found.device), found
        found = run(session.policy.model, _linked_zero, empty_batch(), session.device)
        assert isinstance(found, torch.Tensor)
        return None, found

    def vectors(self) -> torch.Tensor:
        """Every sample's vector, `[N, H]` in sample order: with gradients where enabled in
        one process; under torchrun, each rank's share all-reduced (without gradients)."""
        comm = self.session.comm
        parts = [self.round(i) for i in range(self.rounds)]
        if comm.world_size == 1:
            order = torch.cat([index for index, _ in parts if index is not None])
            found = torch.cat([vectors for index, vectors in parts if index is not None])
            return torch.empty_like(found).index_copy(0, order, found)
        out = torch.zeros(self.count, self.width, device=comm.device)
        for index, found in parts:
            if index is not None:
                out[index.to(out.device)] = found.detach().to(out.device)
        return comm.sum_(out)


def _linked_zero(model: Any, batch: MicroBatch, device: torch.device) -> torch.Tensor:
    """The decoder over `batch` (one masked token), summed and times zero: a backward of it
    runs every FSDP unit and adds nothing."""
    hidden_N_H, _ = decoder_states(model, batch, device)
    return hidden_N_H.float().sum() * 0.0


def _forward_result(
    vectors: torch.Tensor, objective: EmbeddingObjective, grads: torch.Tensor | None
) -> dict[str, Any]:
    metrics: dict[str, float] = {}
    if objective.output == "contrastive_loss":
        _, metrics = _objective(vectors, objective, grads)
    found = outputs(vectors, objective)
    rows = None if found is None else found.detach().cpu().tolist()
    return {"outputs": rows, "metrics": metrics}


def _objective(
    vectors: torch.Tensor, objective: EmbeddingObjective, grads: torch.Tensor | None
) -> tuple[torch.Tensor, dict[str, float]]:
    """`objective_value`, refused as NON_FINITE_LOSS when it is not finite."""
    value, metrics = objective_value(vectors, objective, grads)
    if not torch.isfinite(value):
        raise OperationError("NON_FINITE_LOSS", f"the objective is not finite ({float(value)})")
    return value, metrics


def _backward(call: _Call, grads: torch.Tensor | None) -> dict[str, float]:
    """Backpropagate the objective; its metrics."""
    session, objective = call.session, call.objective
    if objective.couples_samples and session.comm.world_size == 1 and call.rounds == 1:
        value, metrics = _objective(call.vectors(), objective, grads)
        value.backward()
        session.widen_grads()
        return metrics
    metrics = {}
    if objective.couples_samples:
        # the RNG states are put back after it: the second forward draws the same dropout masks
        devices = cuda_devices(session.resource.device)
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            vectors = call.vectors()
        leaf = vectors.detach().requires_grad_(True)
        value, metrics = _objective(leaf, objective, grads)
        (coefficients,) = torch.autograd.grad(value, leaf)
    else:
        assert grads is not None
        coefficients = grads
    for i in range(call.rounds):
        index, found = call.round(i)
        if index is None:
            found.backward()  # a rank with no samples left: zero, through every unit
        else:
            part = coefficients[index.to(coefficients.device)].to(found.device)
            (part * found).sum().backward()
        session.widen_grads()
    return metrics
