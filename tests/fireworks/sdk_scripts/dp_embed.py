"""The Fireworks SDK's embedding calls on the worker (docs/semantics.md §27).

    python dp_embed.py <base_model> <lora_rank> <seqs_json>

The sequences are 2 queries, then their 2 positives. Printed as one JSON object:
- `vectors_mean`, `vectors_last`, `rows_last`: what `forward_backward_custom(output=...)`
  hands its loss (pooled vectors; rows of the similarity matrix), with a zero loss;
- `client_loss`: the InfoNCE the client computed in `output="embedding"` mode, and
  `contrastive`: the metrics of `forward_backward_contrastive` on the same weights;
- `projection`: the refusal of `forward_projection` (where the SDK has it).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.nn.functional as F
from fireworks.training.sdk.client import FiretitanServiceClient

try:  # 1.2.30 vendors tinker 0.23 as `_core`; 1.2.9 depends on the `tinker` package
    from fireworks.training.sdk._core import types
except ImportError:  # pragma: no cover - the other SDK line
    from tinker import types  # type: ignore[no-redef]

B, TAU = 2, 0.05


def info_nce(_data: Any, embeddings: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
    z = F.normalize(torch.stack(embeddings), dim=-1)
    sim = z[:B] @ z[B:].T / TAU
    t = torch.arange(B)
    loss = 0.5 * (F.cross_entropy(sim, t) + F.cross_entropy(sim.T, t))
    return loss, {"loss": float(loss)}


def main() -> None:
    base_model, rank, seqs = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    service = FiretitanServiceClient(
        base_url=os.environ["FIREWORKS_BASE_URL"], api_key=os.environ["FIREWORKS_API_KEY"]
    )
    client = service.create_training_client(base_model=base_model, lora_rank=rank, seed=0)
    data = [types.Datum(model_input=types.ModelInput.from_ints(s), loss_fn_inputs={}) for s in seqs]
    out: dict[str, Any] = {}
    for key, output, pooling in (
        ("vectors_mean", "embedding", "mean"),
        ("vectors_last", "embedding", "last"),
        ("rows_last", "cos_similarity_matrix", "last"),
    ):

        def record(_data: Any, embeddings: list[torch.Tensor], key: str = key) -> Any:
            out[key] = [e.detach().tolist() for e in embeddings]
            return sum((e * 0).sum() for e in embeddings), {}

        client.forward_backward_custom(data, record, output=output, pooling=pooling).result()
    fb = client.forward_backward_custom(data, info_nce, output="embedding", pooling="last")
    out["client_loss"] = float(fb.result().metrics["loss"])
    contrastive = client.forward_backward_contrastive(
        data, num_queries=B, temperature=TAU, pooling="last"
    )
    out["contrastive"] = dict(contrastive.result().metrics)
    if hasattr(client, "forward_projection"):
        try:
            client.forward_projection(data).result()
            out["projection"] = "accepted"
        except Exception as exc:  # the SDK raises the worker's 400
            out["projection"] = str(exc)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
