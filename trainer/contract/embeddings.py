"""Embedding calls: what a forward(-backward) over pooled hidden states computes, and the rules
of its request (docs/semantics.md §27).

A call's samples are token sequences only. Each is pooled from the decoder's last hidden state
(the output head's input): the mean over its positions, or its last position. The objective
(`output`) is a function of those pooled vectors `P` (`[N, H]`, one row per sample):
- `embedding`: a forward returns `P`; a backward takes one gradient `g_i ∈ R^H` per sample and
  backpropagates `Σ_i g_i · P_i`;
- `cos_similarity_matrix`: a forward returns the rows of `S = Ẑ Ẑᵀ` (`Ẑ`: `P` with unit rows);
  a backward takes the rows of `G = dL/dS` and backpropagates `Σ_ij G_ij S_ij`;
- `contrastive_loss`: bidirectional in-batch InfoNCE over `[Q_0..Q_{B-1}, D_0..D_{B-1},
  X_0..X_{K-1}]`, computed and backpropagated here.
Numpy only, so the edge can run the rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
from pydantic import Field

from trainer.contract.base import Spec
from trainer.contract.errors import InputError
from trainer.contract.rules import (
    GradientLike,
    Limits,
    SampleLike,
    check_count,
    check_finite,
    check_model_input,
    check_token_budget,
    token_values,
)

EmbeddingOutput = Literal["embedding", "cos_similarity_matrix", "contrastive_loss"]
Pooling = Literal["mean", "last"]
OUTPUTS: tuple[str, ...] = ("embedding", "cos_similarity_matrix", "contrastive_loss")


class EmbeddingObjective(Spec):
    """What an embedding call computes from its samples' pooled vectors (module docstring)."""

    output: EmbeddingOutput
    pooling: Pooling = "mean"
    # contrastive_loss only: B, the temperature τ (logits are cosines / τ), and K
    num_queries: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)
    num_extra_negatives: int = Field(default=0, ge=0)

    @property
    def couples_samples(self) -> bool:
        """Whether a sample's gradient depends on the other samples' vectors (every output but
        `embedding`, whose gradients the client computed)."""
        return self.output != "embedding"


def takes_gradients(output: str, forward_only: bool) -> bool:
    """Whether a call reads one gradient per sample: a backward of a client-side objective
    (`embedding`, `cos_similarity_matrix`)."""
    return not forward_only and output != "contrastive_loss"


def check_embedding_width(size: int, hidden: int | None, field: str) -> None:
    """An `embedding` gradient has the model's hidden size (None: not known here)."""
    if hidden is not None and size != hidden:
        raise InputError(field, f"has {size} values for an embedding of hidden size {hidden}")


def check_embedding_call(
    samples: Sequence[SampleLike],
    objective: EmbeddingObjective,
    forward_only: bool,
    gradients: Sequence[GradientLike] | None,
    limits: Limits,
    hidden: int | None = None,
) -> None:
    """An embedding call's samples, objective and gradients (`InputError` naming the field);
    `hidden`: the model's hidden size, where it is known (an `embedding` gradient's length)."""
    check_count(len(samples), limits)
    lengths = []
    for i, sample in enumerate(samples):
        field = f"samples[{i}]"
        ids = check_model_input(token_values(sample.model_input), f"{field}.model_input", limits)
        lengths.append(len(ids))
        if sample.loss_fn_inputs:
            name = sorted(sample.loss_fn_inputs)[0]
            raise InputError(f"{field}.loss_fn_inputs.{name}", "an embedding call reads none")
    check_token_budget(sum(lengths), limits)
    _check_objective(objective, len(samples))
    _check_gradients(objective, forward_only, gradients, len(samples), hidden)


def _check_objective(objective: EmbeddingObjective, count: int) -> None:
    if objective.output != "contrastive_loss":
        for name in ("num_queries", "temperature"):
            if getattr(objective, name) is not None:
                raise InputError(f"objective.{name}", "is read by contrastive_loss only")
        if objective.num_extra_negatives:
            raise InputError("objective.num_extra_negatives", "is read by contrastive_loss only")
        return
    for name in ("num_queries", "temperature"):
        if getattr(objective, name) is None:
            raise InputError(f"objective.{name}", "is required by contrastive_loss")
    assert objective.num_queries is not None
    want = 2 * objective.num_queries + objective.num_extra_negatives
    if count != want:
        raise InputError(
            "samples",
            f"contrastive_loss takes 2 * num_queries + num_extra_negatives = {want} samples "
            f"(queries, then their positives, then the extra negatives), got {count}",
        )


def _check_gradients(
    objective: EmbeddingObjective,
    forward_only: bool,
    gradients: Sequence[GradientLike] | None,
    count: int,
    hidden: int | None,
) -> None:
    if not takes_gradients(objective.output, forward_only):
        if gradients is not None:
            why = "a forward" if forward_only else "contrastive_loss computes its own"
            raise InputError("gradients", f"are not taken: {why}")
        return
    if gradients is None:
        raise InputError("gradients", f"are required: one per sample for {objective.output}")
    if len(gradients) != count:
        raise InputError("gradients", f"has {len(gradients)} entries for {count} samples")
    for i, gradient in enumerate(gradients):
        data = np.asarray(gradient.data)
        if objective.output == "cos_similarity_matrix" and len(data) != count:
            raise InputError(
                f"gradients[{i}].data",
                f"has {len(data)} values for a row of the {count} x {count} similarity matrix",
            )
        if len(data) == 0:
            raise InputError(f"gradients[{i}].data", "is empty")
        if objective.output == "embedding":
            check_embedding_width(len(data), hidden, f"gradients[{i}].data")
        check_finite(data, f"gradients[{i}].data")
