"""One arm of `scripts/bench_fireworks_steps.py`, run by the tinker venv's python.

    python tinker_steps.py BASE_MODEL STEPS BATCH TOKENS

The same steps as `fireworks_steps.py` through the `tinker` 0.38 SDK's `TrainingClient` on the
Tinker face itself (LoRA rank 8 on the base model's shared resource). Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
import time

import tinker
from tinker import types


def batch(size: int, tokens: int) -> list[types.Datum]:
    out = []
    for row in range(size):
        ids = [(7 + row + 3 * i) % 28 + 6 for i in range(tokens + 1)]
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={
                    "target_tokens": types.TensorData(data=ids[1:], dtype="int64", shape=[tokens]),
                    "weights": types.TensorData(
                        data=[1.0] * tokens, dtype="float32", shape=[tokens]
                    ),
                },
            )
        )
    return out


def main() -> None:
    base_model, steps, size, tokens = sys.argv[1], *map(int, sys.argv[2:5])
    service = tinker.ServiceClient()
    client = service.create_lora_training_client(base_model=base_model, rank=8)
    data = batch(size, tokens)
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        client.forward_backward(data, "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=1e-4)).result()
        seconds.append(time.perf_counter() - start)
    print(json.dumps({"seconds": seconds}))


if __name__ == "__main__":
    main()
