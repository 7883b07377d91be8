"""One arm of `scripts/bench_grpo_steps.py`, run by the tinker venv's python.

    python tinker_grpo.py BASE_MODEL STEPS GROUP TOKENS

The same GRPO step as `fireworks_grpo.py` through the `tinker` 0.38 SDK: `sample` on the
sampling client of the policy's latest weights (GROUP completions), `forward`,
`forward_backward_custom`, `optim_step`, `save_weights_and_get_sampling_client`. LoRA rank 8 on
the Tinker face. Prints one JSON line: each step's seconds.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import tinker
from grpo_common import LR, PROMPT, datums, loss_fn, rewards
from tinker import types


def main() -> None:
    base_model, steps, group, tokens = sys.argv[1], *map(int, sys.argv[2:5])
    service = tinker.ServiceClient()
    policy = service.create_lora_training_client(base_model=base_model, rank=8)
    sampler = policy.save_weights_and_get_sampling_client("step-0")
    params = types.SamplingParams(max_tokens=tokens, temperature=1.0)
    seconds, phases = [], []
    for step in range(steps):
        start = time.perf_counter()
        prompt = types.ModelInput.from_ints(PROMPT)
        out = sampler.sample(prompt, num_samples=group, sampling_params=params).result()
        completions = [list(s.tokens) for s in out.sequences]
        sampled_at = time.perf_counter()
        data = datums(types, completions)
        policy.forward(data, "cross_entropy").result()
        policy.forward_backward_custom(data, loss_fn(rewards(completions))).result()
        policy.optim_step(types.AdamParams(learning_rate=LR)).result()
        synced_from = time.perf_counter()
        sampler = policy.save_weights_and_get_sampling_client(f"step-{step + 1}")
        phases.append((sampled_at - start, time.perf_counter() - synced_from))
        seconds.append(time.perf_counter() - start)
    print(json.dumps({"seconds": seconds, "phases": phases}))


if __name__ == "__main__":
    main()
