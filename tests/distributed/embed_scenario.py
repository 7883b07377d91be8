"""Embedding calls for the 2-rank test (docs/semantics.md §27), shared by the 1-process reference
and the gloo run (`spmd_case embed`): the same function drives a `ModelResource` and a
`DistributedResource`."""

from __future__ import annotations

from typing import Any

import torch

from tests.distributed.scenario import ADAM, session_spec
from tests.engine.helpers import random_batch
from trainer.contract.embeddings import EmbeddingObjective
from trainer.contract.specs import Gradient, Sample

# 7 texts (3 queries, their 3 positives, 1 extra negative) of uneven lengths: several
# micro-batches under the tests' small budgets, split unevenly over two ranks
TEXTS = 7
CONTRASTIVE = EmbeddingObjective(
    output="contrastive_loss", num_queries=3, temperature=0.5, num_extra_negatives=1
)


def _texts(seed: int) -> list[Sample]:
    return [Sample(model_input=s.model_input) for s in random_batch(seed, n=TEXTS, lengths=(3, 14))]


def drive_embed(resource: Any, kind: str, width: int) -> dict[str, Any]:
    """Vectors (mean and last pooling) and cosine rows forward; two steps, each an InfoNCE
    backward and an `embedding` backward of fixed gradients, then AdamW; vectors again after
    them; a training checkpoint."""
    session = resource.create_session(f"{kind}-e", session_spec(kind))
    texts = _texts(900)
    out: dict[str, Any] = {"forward": [], "steps": []}
    for pooling in ("mean", "last"):
        found = session.embedding_forward_backward(
            texts, EmbeddingObjective(output="embedding", pooling=pooling), True
        )
        out["forward"].append(found["outputs"])
    cosine = EmbeddingObjective(output="cos_similarity_matrix")
    out["forward"].append(session.embedding_forward_backward(texts, cosine, True)["outputs"])
    grads = torch.randn(TEXTS, width, generator=torch.Generator().manual_seed(5))
    for step in range(2):
        info = session.embedding_forward_backward(_texts(910 + step), CONTRASTIVE)
        given = [Gradient(data=g.tolist()) for g in grads]
        plain = EmbeddingObjective(output="embedding")
        session.embedding_forward_backward(_texts(920 + step), plain, False, given)
        optim = session.optim_step(ADAM)
        out["steps"].append([info["metrics"]["loss"], optim["metrics"]["grad_norm"]])
    after = session.embedding_forward_backward(texts, CONTRASTIVE, True)
    out["after"] = after["metrics"]["loss"]
    out["training"] = session.save_training_checkpoint().id
    resource.close_session(f"{kind}-e")
    return out
