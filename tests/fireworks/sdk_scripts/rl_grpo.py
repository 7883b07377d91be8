"""The SDK's minimal lifecycle example as its README writes it, then a GRPO loop on it driven
the way the cookbook's `rl_loop.py` drives one.

    python rl_grpo.py <base_model> <lora_rank> <deployment_id> <tokenizer_dir> <steps>

1. `DeploymentManager.create_or_get` + `wait_for_ready`; `TrainerJobManager.create_and_wait`
   with `hot_load_deployment_id`; `FiretitanServiceClient` on the job's endpoint;
   `create_training_client`; `WeightSyncer(...).save_and_hotload("step-1")` (README verbatim,
   the key and URL from the environment).
2. Each step: `DeploymentSampler.sample_with_prompt_tokens(n=4, logprobs=True)` on the
   deployment; the policy's `forward` of every completion at the same weights (the gap between
   the deployment's logprobs and the trainer's is recorded); a reward (the share of completion
   tokens equal to `GOOD`); a GRPO-style policy-gradient loss through
   `forward_backward_custom`; `optim_step`; `save_and_hotload(f"step-{k}")`.

Prints one JSON object: the rewards per step, the largest logprob gap, the hot-load status and
the identities loaded.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import torch
from fireworks.training.sdk import (
    DeploymentConfig,
    DeploymentManager,
    FiretitanServiceClient,
    TrainerJobConfig,
    TrainerJobManager,
    WeightSyncer,
)
from fireworks.training.sdk.sampling import DeploymentSampler
from transformers import AutoTokenizer

try:  # 1.2.30 vendors its Tinker types; 1.2.9 uses the tinker package
    from fireworks.training.sdk import types
except ImportError:
    from tinker import types  # type: ignore[no-redef]

PROMPT = [10, 11, 12, 13]
GOOD_BELOW = 20  # the reward counts the completion tokens with smaller ids
N = 4


def datum(tokens: list[int], prompt_len: int) -> types.Datum:
    n = len(tokens) - 1
    weights = [0.0 if i + 1 < prompt_len else 1.0 for i in range(n)]
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=tokens[1:], dtype="int64", shape=[n]),
            "weights": types.TensorData(data=weights, dtype="float32", shape=[n]),
        },
    )


def pg_loss(outputs, advantages: list[float], prompt_lens: list[int]) -> float:
    """The policy-gradient loss of a batch from its `forward` logprobs (as `loss_fn`)."""
    return -sum(
        a * sum(out["logprobs"].data[p - 1 :])
        for out, a, p in zip(outputs, advantages, prompt_lens, strict=True)
    )


def main() -> None:
    base_model, rank, deployment_id = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    tokenizer_dir, steps = sys.argv[4], int(sys.argv[5])
    key, url = os.environ["FIREWORKS_API_KEY"], os.environ["FIREWORKS_BASE_URL"]

    # -- the README's lifecycle example ---------------------------------------------------
    trainer_mgr = TrainerJobManager(api_key=key, base_url=url)
    deploy_mgr = DeploymentManager(api_key=key, base_url=url)
    deploy = deploy_mgr.create_or_get(
        DeploymentConfig(deployment_id=deployment_id, base_model=base_model, region="US_VIRGINIA_1")
    )
    deploy_mgr.wait_for_ready(deploy.deployment_id)
    endpoint = trainer_mgr.create_and_wait(
        TrainerJobConfig(
            base_model=base_model,
            display_name="my-trainer",
            hot_load_deployment_id=deploy.deployment_id,
            region="US_VIRGINIA_1",
            lora_rank=rank,
        )
    )
    service = FiretitanServiceClient(base_url=endpoint.base_url, api_key=key)
    policy = service.create_training_client(base_model=base_model, lora_rank=rank)
    syncer = WeightSyncer(
        policy_client=policy,
        deploy_mgr=deploy_mgr,
        deployment_id=deploy.deployment_id,
        base_model=base_model,
        lora_rank=rank,
    )
    identities = [syncer.save_and_hotload("step-1")]

    # -- GRPO on it -----------------------------------------------------------------------
    sampler = DeploymentSampler(
        inference_url=url,
        model=f"accounts/{deploy_mgr.account_id}/deployments/{deploy.deployment_id}",
        api_key=key,
        tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir),
    )
    report = asyncio.run(grpo(policy, syncer, sampler, steps, identities))
    status = deploy_mgr.hotload_check_status(deploy.deployment_id, base_model)
    print(json.dumps({"job_id": endpoint.job_id, **report, "status": status}))


async def grpo(policy, syncer, sampler, steps: int, identities: list) -> dict:
    """The steps, in one event loop as the cookbook's recipe runs them (the sampler's HTTP
    client belongs to the loop it first ran in)."""
    lr = 1e-3 if syncer.lora_rank else 1e-4
    rewards, gaps, before, after = [], [], [], []
    for step in range(steps):
        sampled = await sampler.sample_with_prompt_tokens(
            PROMPT, n=N, max_tokens=8, temperature=1.0, top_p=1.0, top_k=0, logprobs=True
        )
        data = [datum(s.full_tokens, s.prompt_len) for s in sampled]
        forward = policy.forward(data, "cross_entropy").result()
        for s, out in zip(sampled, forward.loss_fn_outputs, strict=True):
            trainer_lp = out["logprobs"].data[s.prompt_len - 1 :]
            assert len(trainer_lp) == len(s.inference_logprobs), (trainer_lp, s)
            gaps.append(max(abs(a - b) for a, b in zip(trainer_lp, s.inference_logprobs)))
        scores = [
            sum(t < GOOD_BELOW for t in s.full_tokens[s.prompt_len :]) / max(1, s.completion_len)
            for s in sampled
        ]
        mean = sum(scores) / len(scores)
        rewards.append(mean)
        advantages = [r - mean for r in scores]
        prompt_lens = [s.prompt_len for s in sampled]

        def loss_fn(batch, logprobs_list, advantages=advantages, prompt_lens=prompt_lens):
            loss = torch.zeros(())
            for logprobs, advantage, plen in zip(logprobs_list, advantages, prompt_lens):
                loss = loss - advantage * logprobs[plen - 1 :].sum()
            return loss, {"pg_loss": float(loss)}

        before.append(pg_loss(forward.loss_fn_outputs, advantages, prompt_lens))
        policy.forward_backward_custom(data, loss_fn).result()
        policy.optim_step(types.AdamParams(learning_rate=lr)).result()
        outputs = policy.forward(data, "cross_entropy").result().loss_fn_outputs
        after.append(pg_loss(outputs, advantages, prompt_lens))
        identities.append(syncer.save_and_hotload(f"step-{step + 2}"))

    return {
        "rewards": rewards,
        "loss_before": before,
        "loss_after": after,
        "max_gap": max(gaps),
        "identities": identities,
    }


if __name__ == "__main__":
    main()
