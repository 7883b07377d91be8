"""An RL loop through the official `tinker` SDK (run by the tinker venv's python) on a worker
whose samples run on vLLM: save weights for the sampler, sample a group, score it with the
training client's own forward, one importance-sampling step; three times.

Usage: python tinker_rl.py BASE_MODEL [STEPS]. Prints one JSON object; tests/vllm/test_tinker.py
checks the numbers, scripts/bench_tinker_steps.py times the steps.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import tinker
from tinker import types

PROMPT = [5, 9, 14, 20]
GROUP = 4


def main(base_model: str, count: int = 3) -> dict[str, Any]:
    service = tinker.ServiceClient()
    training = service.create_lora_training_client(base_model=base_model, rank=8, seed=0)
    steps: list[dict[str, Any]] = []
    samplers = []
    for step in range(count):
        t0 = time.monotonic()
        sampler = training.save_weights_and_get_sampling_client(name=f"step{step}")
        samplers.append(sampler)
        t_sampler = time.monotonic() - t0
        params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=10 + step)
        t0 = time.monotonic()
        result = sampler.sample(
            prompt=types.ModelInput.from_ints(PROMPT), num_samples=GROUP, sampling_params=params
        ).result()
        t_sample = time.monotonic() - t0
        sequences = [
            {"tokens": list(s.tokens), "logprobs": [float(x) for x in s.logprobs or []]}
            for s in result.sequences
        ]
        full = [PROMPT + s["tokens"] for s in sequences]
        computed = [sampler.compute_logprobs(types.ModelInput.from_ints(f)).result() for f in full]
        datums = [
            types.Datum(
                model_input=types.ModelInput.from_ints(f[:-1]),
                loss_fn_inputs={"target_tokens": f[1:], "weights": [1.0] * (len(f) - 1)},
            )
            for f in full
        ]
        forward = training.forward(datums, "cross_entropy").result()
        trainer_lps = [[float(x) for x in o["logprobs"].tolist()] for o in forward.loss_fn_outputs]
        rewards = [sum(t % 2 for t in s["tokens"]) / len(s["tokens"]) for s in sequences]
        mean = sum(rewards) / len(rewards)
        rl = []
        for f, s, r in zip(full, sequences, rewards, strict=True):
            pad = [0.0] * (len(PROMPT) - 1)
            rl.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(f[:-1]),
                    loss_fn_inputs={
                        "target_tokens": f[1:],
                        "logprobs": pad + s["logprobs"],
                        "advantages": pad + [r - mean] * len(s["tokens"]),
                    },
                )
            )
        training.forward_backward(rl, "importance_sampling").result()
        training.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        steps.append(
            {
                "sequences": sequences,
                "computed": [[None if x is None else float(x) for x in c] for c in computed],
                "trainer": trainer_lps,
                "seconds": {"sampler": t_sampler, "sample": t_sample},
            }
        )
    # the first sampler again, after later saves moved the training session on: its own weights
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=10)
    again = (
        samplers[0]
        .sample(
            prompt=types.ModelInput.from_ints(PROMPT), num_samples=GROUP, sampling_params=params
        )
        .result()
    )
    first_again = [
        {"tokens": list(s.tokens), "logprobs": [float(x) for x in s.logprobs or []]}
        for s in again.sequences
    ]
    return {"prompt": PROMPT, "steps": steps, "first_again": first_again}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3)))
