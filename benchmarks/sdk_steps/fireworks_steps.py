"""One arm of `scripts/bench_fireworks_steps.py`, run by the fireworks-ai venv's python.

    python fireworks_steps.py BASE_MODEL STEPS BATCH TOKENS

Creates an RLOR trainer job through `TrainerJobManager.create_and_wait` (LoRA rank 8), then
runs STEPS training steps through the job's `FiretitanTrainingClient`: one cross-entropy
`forward_backward` of BATCH datums of TOKENS tokens, then `optim_step`, each waited for.
Prints one JSON line: the seconds of each step. The job is deleted at the end.
"""

from __future__ import annotations

import json
import os
import sys
import time

from fireworks.training.sdk import (
    AdamParams,
    Datum,
    FiretitanServiceClient,
    ModelInput,
    TensorData,
    TrainerJobConfig,
    TrainerJobManager,
)


def batch(size: int, tokens: int) -> list[Datum]:
    out = []
    for row in range(size):
        ids = [(7 + row + 3 * i) % 28 + 6 for i in range(tokens + 1)]
        out.append(
            Datum(
                model_input=ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={
                    "target_tokens": TensorData(data=ids[1:], dtype="int64", shape=[tokens]),
                    "weights": TensorData(data=[1.0] * tokens, dtype="float32", shape=[tokens]),
                },
            )
        )
    return out


def main() -> None:
    base_model, steps, size, tokens = sys.argv[1], *map(int, sys.argv[2:5])
    key, url = os.environ["FIREWORKS_API_KEY"], os.environ["FIREWORKS_BASE_URL"]
    jobs = TrainerJobManager(api_key=key, base_url=url)
    config = TrainerJobConfig(base_model=base_model, lora_rank=8, learning_rate=1e-4)
    endpoint = jobs.create_and_wait(config, poll_interval_s=0.2)
    service = FiretitanServiceClient(base_url=endpoint.base_url, api_key=key)
    client = service.create_training_client(base_model=base_model, lora_rank=8)
    data = batch(size, tokens)
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        client.forward_backward(data, "cross_entropy").result()
        client.optim_step(AdamParams(learning_rate=1e-4)).result()
        seconds.append(time.perf_counter() - start)
    jobs.delete(endpoint.job_id)
    print(json.dumps({"seconds": seconds}))


if __name__ == "__main__":
    main()
