"""Pooled hidden states and the objectives over them (`trainer.contract.embeddings`;
docs/semantics.md §27). Every vector and objective is float32, whatever the model's dtype."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from trainer.compute.batch import MicroBatch
from trainer.contract.embeddings import EmbeddingObjective


def pool(
    hidden_P_H: torch.Tensor, sample_index_P: torch.Tensor, count: int, pooling: str
) -> torch.Tensor:
    """`[count, H]` fp32: per sample, the mean of its positions' states or its last one.
    `hidden_P_H` holds every position of the `count` samples, sample after sample, in order."""
    hidden = hidden_P_H.float()
    lengths = torch.bincount(sample_index_P, minlength=count)
    if pooling == "last":
        return hidden[torch.cumsum(lengths, 0) - 1]
    sums = hidden.new_zeros(count, hidden.shape[-1]).index_add(0, sample_index_P, hidden)
    return sums / lengths[:, None].to(hidden.dtype)


def batch_embeddings(
    model: Any, batch: MicroBatch, device: torch.device, pooling: str
) -> torch.Tensor:
    """The decoder over a micro-batch (laid out as for logprobs: `MicroBatch.decoder_inputs`),
    each sample pooled: `[len(batch.samples), H]` in `batch.samples` order. Every position of
    each sample must be kept (`PreparedSample.keep_all`)."""
    hidden_N_H, keep_P = decoder_states(model, batch, device)
    index_P = batch.sample_index_P.to(device)
    return pool(hidden_N_H[keep_P], index_P, len(batch.samples), pooling)


def decoder_states(
    model: Any, batch: MicroBatch, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder's last hidden states over a micro-batch, `[rows·T, H]`, and which of those
    positions are the samples' (`keep_P`)."""
    dtype = getattr(model, "dtype", torch.float32)
    inputs, keep_P = batch.decoder_inputs(model.config._attn_implementation, device, dtype)
    hidden = model.get_decoder()(**inputs, use_cache=False).last_hidden_state
    return hidden.reshape(-1, hidden.shape[-1]), keep_P


def similarity(vectors_N_H: torch.Tensor) -> torch.Tensor:
    """`S = Ẑ Ẑᵀ`: the cosine of every pair (`Ẑ`: the rows scaled to unit length)."""
    unit = F.normalize(vectors_N_H, p=2.0, dim=-1)
    return unit @ unit.T


def contrastive(
    vectors_N_H: torch.Tensor, objective: EmbeddingObjective
) -> tuple[torch.Tensor, dict[str, float]]:
    """Bidirectional in-batch InfoNCE. Rows: B queries, their B positives, K extra negatives.
    Query i against every document (positives and extras), its positive the target; positive
    i against every query, query i the target; the loss is the mean of the two mean
    cross-entropies."""
    assert objective.num_queries is not None and objective.temperature is not None
    b, tau = objective.num_queries, objective.temperature
    unit = F.normalize(vectors_N_H, p=2.0, dim=-1)
    queries, documents = unit[:b], unit[b:]
    q2d = queries @ documents.T / tau  # [B, B + K]
    d2q = documents[:b] @ queries.T / tau  # [B, B]
    targets = torch.arange(b, device=unit.device)
    loss_q2d = F.cross_entropy(q2d, targets)
    loss_d2q = F.cross_entropy(d2q, targets)
    loss = 0.5 * (loss_q2d + loss_d2q)
    with torch.no_grad():
        recall = (q2d.argmax(dim=1) == targets).float().mean()
    metrics = {
        "loss": float(loss.detach()),
        "loss_q2d": float(loss_q2d.detach()),
        "loss_d2q": float(loss_d2q.detach()),
        "in_batch_recall_at_1": float(recall),
    }
    return loss, metrics


def objective_value(
    vectors_N_H: torch.Tensor,
    objective: EmbeddingObjective,
    gradients: torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The scalar a backward differentiates, and its metrics: `Σ g·P` (`embedding`),
    `Σ G ⊙ S` (`cos_similarity_matrix`), or the InfoNCE loss (`contrastive_loss`)."""
    if objective.output == "contrastive_loss":
        return contrastive(vectors_N_H, objective)
    assert gradients is not None
    grads = gradients.to(vectors_N_H.device)
    if objective.output == "cos_similarity_matrix":
        return (grads * similarity(vectors_N_H)).sum(), {}
    return (grads * vectors_N_H).sum(), {}


def outputs(vectors_N_H: torch.Tensor, objective: EmbeddingObjective) -> torch.Tensor | None:
    """What a forward returns per sample: its vector, its row of `S`, or nothing."""
    if objective.output == "embedding":
        return vectors_N_H
    if objective.output == "cos_similarity_matrix":
        return similarity(vectors_N_H)
    return None
