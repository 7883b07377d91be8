"""Soft targets through the official `tinker` SDK (run by the tinker venv's python): datums
whose `target_tokens` and `weights` are (N, K), as tinker-cookbook's SDFT builds them.

Usage: python soft_targets.py BASE_MODEL
Env: TINKER_BASE_URL, TINKER_API_KEY (the SDK reads them).

Sends the same table dense (`TensorData.from_torch`) and as torch tensors, which the SDK
encodes as sparse CSR when that is smaller; a one-column table beside its 1-D twin; a
forward-backward; a bad shape; and the same soft cross entropy twice, once as the server's
`cross_entropy` and once as a client-side custom loss (`forward_backward_custom`, whose
backward sends `weights = -dL/dlogprobs` as a 2-D torch tensor), each on its own client from
one seed, then one optimizer step each. Prints one JSON object; tests/tinker/test_soft_sdk.py
judges it.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import tinker
import torch
from tinker import types

from tests.tinker.sdk_scripts.report import print_result

RANK, LR = 4, 1e-2
N, K = 12, 8
ROWS = (3, 5, 8, 11)  # the positions that carry weights; the rest are 0 (sparse, like SDFT's)


def table(vocab: int, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(6, vocab, size=N + 1).tolist()
    targets = np.zeros((N, K), dtype=np.int64)
    weights = np.zeros((N, K), dtype=np.float32)
    for t in ROWS:
        targets[t] = rng.permutation(vocab)[:K]
        logits = rng.normal(size=K)
        weights[t] = np.exp(logits) / np.exp(logits).sum()
    return {"tokens": tokens, "targets": targets.tolist(), "weights": weights.tolist()}


def dense(d: dict[str, Any]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(d["tokens"][:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_torch(torch.tensor(d["targets"])),
            "weights": types.TensorData.from_torch(torch.tensor(d["weights"])),
        },
    )


def as_torch(d: dict[str, Any]) -> types.Datum:
    """Torch tensors in `loss_fn_inputs`: the SDK picks sparse CSR for 2-D targets/weights."""
    return types.Datum(
        model_input=types.ModelInput.from_ints(d["tokens"][:-1]),
        loss_fn_inputs={
            "target_tokens": torch.tensor(d["targets"]),
            "weights": torch.tensor(d["weights"]),
        },
    )


def summary(result: types.ForwardBackwardOutput) -> dict[str, Any]:
    return {
        "logprobs": [out["logprobs"].to_torch().tolist() for out in result.loss_fn_outputs],
        "shapes": [list(out["logprobs"].shape or []) for out in result.loss_fn_outputs],
        "metrics": dict(result.metrics),
    }


def soft_ce(
    data: list[types.Datum], logprobs: list[torch.Tensor]
) -> tuple[torch.Tensor, dict[str, float]]:
    """Σ −w·lp over every datum's (N, K) logprobs, computed by the client."""
    loss = sum(
        -(d.loss_fn_inputs["weights"].to_torch() * lp).sum() for d, lp in zip(data, logprobs)
    )
    assert isinstance(loss, torch.Tensor)
    return loss, {"soft_ce": float(loss.detach())}


def main(base_model: str) -> dict[str, Any]:
    service = tinker.ServiceClient()
    client = service.create_lora_training_client(base_model=base_model, rank=RANK, seed=0)
    vocab = len(client.get_tokenizer())
    raw = [table(vocab, seed) for seed in range(3)]
    out: dict[str, Any] = {"data": raw}

    sparse = [as_torch(d) for d in raw]
    out["encodings"] = [
        [d.loss_fn_inputs[k].sparse_crow_indices is not None for k in ("target_tokens", "weights")]
        for d in sparse
    ]
    out["forward_dense"] = summary(
        client.forward([dense(d) for d in raw], "cross_entropy").result()
    )
    out["forward_sparse"] = summary(client.forward(sparse, "cross_entropy").result())

    # one column (N, 1) against the same targets and weights as 1-D
    column = [
        {
            **d,
            "targets": [[row[0]] for row in d["targets"]],
            "weights": [[row[0]] for row in d["weights"]],
        }
        for d in raw
    ]
    flat = [
        types.Datum(
            model_input=types.ModelInput.from_ints(d["tokens"][:-1]),
            loss_fn_inputs={
                "target_tokens": [row[0] for row in d["targets"]],
                "weights": [row[0] for row in d["weights"]],
            },
        )
        for d in column
    ]
    out["forward_one_column"] = summary(
        client.forward([dense(d) for d in column], "cross_entropy").result()
    )
    out["forward_1d"] = summary(client.forward(flat, "cross_entropy").result())

    # a weights table that does not match the targets' shape
    bad = dense(raw[0])
    bad.loss_fn_inputs["weights"] = types.TensorData.from_torch(torch.ones(N, K - 1))
    try:
        client.forward([bad], "cross_entropy").result()
        out["bad_shape_error"] = None
    except Exception as exc:  # what the SDK raised
        out["bad_shape_error"] = f"{type(exc).__name__}: {exc}"

    # the same loss as the server's cross_entropy and as a client-side custom loss, then a step
    builtin = service.create_lora_training_client(base_model=base_model, rank=RANK, seed=1)
    custom = service.create_lora_training_client(base_model=base_model, rank=RANK, seed=1)
    adam = types.AdamParams(learning_rate=LR, beta1=0.9, beta2=0.95, eps=1e-8)
    out["fb_builtin"] = summary(
        builtin.forward_backward([dense(d) for d in raw], "cross_entropy").result()
    )
    builtin.optim_step(adam).result()
    out["fb_custom"] = summary(
        custom.forward_backward_custom([dense(d) for d in raw], soft_ce).result()
    )
    custom.optim_step(adam).result()
    after = [dense(d) for d in raw]
    out["after_builtin"] = summary(builtin.forward(after, "cross_entropy").result())
    out["after_custom"] = summary(custom.forward(after, "cross_entropy").result())
    return out


if __name__ == "__main__":
    print_result(lambda: main(sys.argv[1]))
