"""Train one step with the Fireworks SDK and save sampler weights, for a deployment to load.

    python dep_save.py <base_model> <lora_rank> <name> <seqs_json>

Prints `{identity, trained}`: the path `save_weights_for_sampler_ext` returned (the snapshot
identity a hot-load names) and the forward logprobs of the saved weights; the trainer then
takes one more step, so the saved weights are no longer the trainer's.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from fireworks.training.sdk.client import FiretitanServiceClient

try:  # 1.2.30 vendors tinker 0.23 as `_core`; 1.2.9 depends on the `tinker` package
    from fireworks.training.sdk._core import types
except ImportError:  # pragma: no cover - the other SDK line
    from tinker import types  # type: ignore[no-redef]


def datum(tokens: list[int]) -> Any:
    n = len(tokens) - 1
    inputs = {
        "target_tokens": types.TensorData(data=tokens[1:], dtype="int64", shape=[n]),
        "weights": types.TensorData(data=[1.0] * n, dtype="float32", shape=[n]),
    }
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def main() -> None:
    base_model, rank, name, seqs = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    service = FiretitanServiceClient(
        base_url=os.environ["FIREWORKS_BASE_URL"], api_key=os.environ["FIREWORKS_API_KEY"]
    )
    client = service.create_training_client(base_model=base_model, lora_rank=rank, seed=0)
    data = [datum(s) for s in json.loads(seqs)]
    adam = types.AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8)
    client.forward_backward(data, "cross_entropy").result()
    client.optim_step(adam).result()
    saved = client.save_weights_for_sampler_ext(name, checkpoint_type="base")
    fwd = client.forward(data, "cross_entropy").result()
    trained = [[float(v) for v in o["logprobs"].data] for o in fwd.loss_fn_outputs]
    client.forward_backward(data, "cross_entropy").result()
    client.optim_step(adam).result()  # the trainer moves on; the snapshot stays
    print(json.dumps({"identity": saved.path, "trained": trained}))


if __name__ == "__main__":
    main()
