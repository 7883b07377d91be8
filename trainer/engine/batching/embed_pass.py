"""An embedding call (docs/semantics.md §27): the samples' pooled hidden states, and a forward's
outputs or a backward of the objective over them. It runs alone, in its session's operation
scope, and keeps its new gradients exactly as a forward-backward pass does (`train_pass`).

An objective that couples the samples (a similarity matrix, InfoNCE) needs every sample's
vector before any gradient. When the call is one micro-batch, the backward runs through it
directly. Otherwise the call runs twice: a forward without gradients gives all vectors `P`;
the objective's gradient `C = df/dP` is taken on them; then each micro-batch's forward again,
with the same dropout draws, backpropagates `Σ_i C_i · P_i`, which has the same gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from trainer.compute.architecture import ROWS, layout_of
from trainer.compute.batch import MicroBatch, PreparedSample, pack
from trainer.compute.embeddings import batch_embeddings, objective_value, outputs
from trainer.compute.policy import cuda_devices
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
    if session.comm.world_size > 1:
        raise OperationError(
            "INVALID_INPUT",
            "embedding outputs are not served on a sharded (torchrun) resource; serve the "
            "model on one process",
        )
    check_embedding_call(samples, objective, forward_only, gradients, limits, hidden_size)
    prepared = [_prepared(i, sample) for i, sample in enumerate(samples)]
    grads = _gradients(gradients)
    model = session.policy.model
    options = session.options
    batches = pack(
        prepared,
        row_tokens=options.row_tokens,
        token_budget=options.token_budget,
        one_per_row=layout_of(model) == ROWS,
    )
    with session.operation_scope(), session.policy.training(train=not forward_only):
        if forward_only:
            try:
                with torch.no_grad():
                    vectors = _vectors(session, batches, objective)
                    return _forward_result(vectors, objective, grads)
            finally:
                session.resource.placement.reshard()
        stash = session.stash_grads()
        try:
            metrics = _backward(session, batches, objective, grads)
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


def _embed(session: PassSession, batch: MicroBatch, pooling: str) -> torch.Tensor:
    model = session.policy.model
    run = session.resource.placement.run
    found = run(model, batch_embeddings, batch, session.device, pooling)
    assert isinstance(found, torch.Tensor)
    return found


def _vectors(
    session: PassSession, batches: Sequence[MicroBatch], objective: EmbeddingObjective
) -> torch.Tensor:
    """Every sample's vector, `[N, H]` in sample order (with gradients where enabled)."""
    parts = [_embed(session, batch, objective.pooling) for batch in batches]
    order = torch.cat([_order(batch) for batch in batches]).to(parts[0].device)
    vectors = torch.cat(parts)
    return torch.empty_like(vectors).index_copy(0, order, vectors)


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


def _backward(
    session: PassSession,
    batches: Sequence[MicroBatch],
    objective: EmbeddingObjective,
    grads: torch.Tensor | None,
) -> dict[str, float]:
    """Backpropagate the objective; its metrics."""
    if objective.couples_samples and len(batches) == 1:
        value, metrics = _objective(_vectors(session, batches, objective), objective, grads)
        value.backward()
        session.widen_grads()
        return metrics
    metrics = {}
    if objective.couples_samples:
        # the RNG states are put back after it: the second forward draws the same dropout masks
        devices = cuda_devices(session.resource.device)
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            vectors = _vectors(session, batches, objective)
        leaf = vectors.detach().requires_grad_(True)
        value, metrics = _objective(leaf, objective, grads)
        (coefficients,) = torch.autograd.grad(value, leaf)
    else:
        assert grads is not None
        coefficients = grads
    for batch in batches:
        vectors = _embed(session, batch, objective.pooling)
        part = coefficients[_order(batch).to(coefficients.device)].to(vectors.device)
        (part * vectors).sum().backward()
        session.widen_grads()
    return metrics
