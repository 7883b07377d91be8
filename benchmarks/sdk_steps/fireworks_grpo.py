"""One arm of `scripts/bench_grpo_steps.py`, run by the Fireworks SDK venv's python.

    python fireworks_grpo.py BASE_MODEL STEPS GROUP TOKENS TOKENIZER_DIR

A GRPO step the Fireworks way: `DeploymentSampler.sample_with_prompt_tokens` on a deployment
(GROUP completions of TOKENS tokens), the policy's `forward` (old-policy logprobs),
`forward_backward_custom`, `optim_step`, `WeightSyncer.save_and_hotload`. The policy is a LoRA
(rank 8) trainer job. Prints one JSON line: each step's seconds.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from fireworks.training.sdk import (
    DeploymentConfig,
    DeploymentManager,
    FiretitanServiceClient,
    TrainerJobConfig,
    TrainerJobManager,
    WeightSyncer,
)
from fireworks.training.sdk.sampling import DeploymentSampler
from grpo_common import LR, PROMPT, datums, loss_fn, rewards
from transformers import AutoTokenizer

try:  # 1.2.30 vendors its Tinker types; 1.2.9 uses the tinker package
    from fireworks.training.sdk import types
except ImportError:
    from tinker import types  # type: ignore[no-redef]


async def run(policy, syncer, sampler, steps: int, group: int, tokens: int) -> tuple:
    seconds, phases = [], []
    for step in range(steps):
        start = time.perf_counter()
        sampled = await sampler.sample_with_prompt_tokens(
            PROMPT, n=group, max_tokens=tokens, temperature=1.0, top_p=1.0, top_k=0, logprobs=True
        )
        completions = [s.full_tokens[s.prompt_len :] for s in sampled]
        sampled_at = time.perf_counter()
        data = datums(types, completions)
        policy.forward(data, "cross_entropy").result()
        policy.forward_backward_custom(data, loss_fn(rewards(completions))).result()
        policy.optim_step(types.AdamParams(learning_rate=LR)).result()
        synced_from = time.perf_counter()
        syncer.save_and_hotload(f"step-{step + 1}")
        phases.append((sampled_at - start, time.perf_counter() - synced_from))
        seconds.append(time.perf_counter() - start)
    return seconds, phases


def main() -> None:
    base_model, steps, group, tokens = sys.argv[1], *map(int, sys.argv[2:5])
    tokenizer = AutoTokenizer.from_pretrained(sys.argv[5])
    key, url = os.environ["FIREWORKS_API_KEY"], os.environ["FIREWORKS_BASE_URL"]
    deploy_mgr = DeploymentManager(api_key=key, base_url=url)
    name = f"bench-{os.getpid()}"
    deploy_mgr.create_or_get(DeploymentConfig(deployment_id=name, base_model=base_model))
    deploy_mgr.wait_for_ready(name)
    jobs = TrainerJobManager(api_key=key, base_url=url)
    endpoint = jobs.create_and_wait(
        TrainerJobConfig(base_model=base_model, lora_rank=8, hot_load_deployment_id=name),
        poll_interval_s=0.2,
    )
    service = FiretitanServiceClient(base_url=endpoint.base_url, api_key=key)
    policy = service.create_training_client(base_model=base_model, lora_rank=8)
    syncer = WeightSyncer(
        policy_client=policy,
        deploy_mgr=deploy_mgr,
        deployment_id=name,
        base_model=base_model,
        lora_rank=8,
        warmup_after_hotload=False,
    )
    syncer.save_and_hotload("step-0")
    sampler = DeploymentSampler(
        inference_url=url,
        model=f"accounts/{deploy_mgr.account_id}/deployments/{name}",
        api_key=key,
        tokenizer=tokenizer,
    )
    seconds, phases = asyncio.run(run(policy, syncer, sampler, steps, group, tokens))
    jobs.delete(endpoint.job_id)
    deploy_mgr.delete(name)
    print(json.dumps({"seconds": seconds, "phases": phases}))


if __name__ == "__main__":
    main()
