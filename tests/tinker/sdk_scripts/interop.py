"""Checkpoints across the two faces, the Tinker side (run by the tinker venv's python).

Usage: python interop.py BASE_MODEL TOGETHER_PATH TOKENS_JSON
- TOGETHER_PATH: `tinker://<session>/weights/<checkpoint>`, a training checkpoint that the RL
  session API saved after one cross-entropy step;
- TOKENS_JSON: a list of token lists, the cross-entropy batch both sides train on.

Loads TOGETHER_PATH with its optimizer and reports the logprobs there and after one more step;
then trains a fresh LoRA model one step and saves it (`save_state("interop")`, and sampler
weights), reporting its logprobs and paths, for the pytest side to resume through /v1/rl.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import tinker
from tinker import types

from tests.tinker.sdk_scripts.report import print_result

LR = 1e-2


def batch(sequences: list[list[int]]) -> list[types.Datum]:
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(s[:-1]),
            loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * (len(s) - 1)},
        )
        for s in sequences
    ]


def logprobs(client: tinker.TrainingClient, data: list[types.Datum]) -> list[list[float]]:
    result = client.forward(data, "cross_entropy").result()
    return [[float(x) for x in out["logprobs"].tolist()] for out in result.loss_fn_outputs]


def step(client: tinker.TrainingClient, data: list[types.Datum]) -> None:
    client.forward_backward(data, "cross_entropy").result()
    client.optim_step(types.AdamParams(learning_rate=LR)).result()


def main(base_model: str, together_path: str, sequences: list[list[int]]) -> dict[str, Any]:
    data = batch(sequences)
    service = tinker.ServiceClient()
    out: dict[str, Any] = {}

    resumed = service.create_lora_training_client(base_model=base_model, rank=4)
    resumed.load_state_with_optimizer(together_path).result()
    out["together_loaded"] = logprobs(resumed, data)
    step(resumed, data)
    out["together_stepped"] = logprobs(resumed, data)

    trained = service.create_lora_training_client(base_model=base_model, rank=4, seed=1)
    step(trained, data)
    out["tinker_stepped"] = logprobs(trained, data)
    out["tinker_state"] = trained.save_state("interop").result().path
    out["tinker_sampler"] = trained.save_weights_for_sampler("interop-sampler").result().path
    return out


if __name__ == "__main__":
    print_result(lambda: main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3])))
