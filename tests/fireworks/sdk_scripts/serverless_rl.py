"""The serverless surface through the official SDK, unchanged: the loop the cookbook's
`examples/serverless_rl/countdown_rl.py` runs, on token prompts.

    python serverless_rl.py <base_model> <tokenizer_dir> <steps>

`FiretitanServiceClient(base_url=$FIREWORKS_BASE_URL + "/training/v1/serverless")`, then
`create_lora_training_client`; before any step, the session's base model sampled through
`create_sampling_client(base_model=...)` (`compute_logprobs`, an echoed completion) against
the policy's `forward` (its LoRA B is zero: the base model). Each step:
`save_weights_for_sampler`, `create_sampling_client(model_path=...)` and `sample(n=4)` with
logprobs (the completions route on the session's checkpoint), the policy's `forward` of every
sample at the same weights (the largest gap is recorded), group-relative advantages of a reward
(the share of completion tokens below `GOOD_BELOW`), `forward_backward("importance_sampling")`,
`optim_step`, and the policy-gradient surrogate of the batch before and after. On the SDK line
that has it (1.2.30), a second service with no model samples the final checkpoint as a
standalone sampler (`create_sampling_route` first). Then `save_state` and
`create_training_client_from_state_with_optimizer` by the path it returned, against the policy
before and after one more step, and a `load_state` (fresh optimizer) beside them.
Last, `create_training_client(lora_rank=0)` on the surface: its error text is recorded.

Prints one JSON object.
"""

from __future__ import annotations

import json
import os
import sys

from fireworks.training.sdk import FiretitanServiceClient
from transformers import AutoTokenizer

try:  # 1.2.30 vendors its Tinker types; 1.2.9 uses the tinker package
    from fireworks.training.sdk import types
except ImportError:
    from tinker import types  # type: ignore[no-redef]

PROMPT = [10, 11, 12, 13]
GOOD_BELOW = 20
N = 4


def is_datum(prompt: list[int], tokens: list[int], lps: list[float], adv: float) -> types.Datum:
    """The cookbook's importance-sampling datum: the model sees prompt + all but the last
    sampled token; targets, sampling logprobs and advantages are zero over the prompt."""
    pad = len(prompt) - 1
    n = pad + len(tokens)
    return types.Datum(
        model_input=types.ModelInput.from_ints(prompt + tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=[0] * pad + tokens, dtype="int64", shape=[n]),
            "logprobs": types.TensorData(data=[0.0] * pad + lps, dtype="float32", shape=[n]),
            "advantages": types.TensorData(
                data=[0.0] * pad + [adv] * len(tokens), dtype="float32", shape=[n]
            ),
        },
    )


def ce_datum(tokens: list[int]) -> types.Datum:
    n = len(tokens) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=tokens[1:], dtype="int64", shape=[n]),
            "weights": types.TensorData(data=[1.0] * n, dtype="float32", shape=[n]),
        },
    )


def completion_logprobs(
    policy, prompt: list[int], completions: list[list[int]]
) -> list[list[float]]:
    """The policy's logprobs of each completion's tokens (its `forward`)."""
    out = policy.forward([ce_datum(prompt + c) for c in completions], "cross_entropy").result()
    return [list(o["logprobs"].data[len(prompt) - 1 :]) for o in out.loss_fn_outputs]


def max_gap(one, other, tokens: list[int]) -> float:
    """The largest difference of two models' logprobs of `tokens` (their `forward`)."""
    a, b = (completion_logprobs(m, tokens[:1], [tokens[1:]])[0] for m in (one, other))
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def surrogate(lps: list[list[float]], advantages: list[float]) -> float:
    return -sum(a * sum(lp) for lp, a in zip(lps, advantages, strict=True))


def main() -> None:
    base_model, tokenizer_dir, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    key, url = os.environ["FIREWORKS_API_KEY"], os.environ["FIREWORKS_BASE_URL"]
    base_url = f"{url}/training/v1/serverless"
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)

    service = FiretitanServiceClient(base_url=base_url, api_key=key)
    policy = service.create_lora_training_client(base_model, rank=4, seed=0)
    report: dict = {
        "base_model": base_model,
        "session_id": service.training_session_id,
        "session_name": service.training_session_name,
        "model_id": policy.model_id,
        "run_id": policy.run_id,
    }

    # the base model through the session's route, against the policy at step 0 (B = 0)
    reference = service.create_sampling_client(base_model=base_model, tokenizer=tokenizer)
    probe = [*PROMPT, 30, 31, 32]
    base_lps = reference.compute_logprobs(types.ModelInput.from_ints(probe)).result()
    trainer_lps = completion_logprobs(policy, PROMPT[:1], [probe[1:]])[0]
    report["base_gap"] = max(abs(a - b) for a, b in zip(base_lps[1:], trainer_lps, strict=True))
    reference.close()

    gaps, before, after, paths, rewards = [], [], [], [], []
    params = types.SamplingParams(max_tokens=8, temperature=1.0)
    for step in range(steps):
        path = policy.save_weights_for_sampler(f"step-{step}").result().path
        paths.append(path)
        sampler = service.create_sampling_client(model_path=path, tokenizer=tokenizer)
        report.setdefault("sampler_models", []).append(sampler.get_base_model())
        result = sampler.sample(types.ModelInput.from_ints(PROMPT), N, params).result()
        sampler.close()
        tokens = [list(s.tokens) for s in result.sequences]
        sampled = [list(s.logprobs) for s in result.sequences]
        trainer = completion_logprobs(policy, PROMPT, tokens)
        for a, b in zip(sampled, trainer, strict=True):
            assert len(a) == len(b), (a, b)
            gaps.append(max(abs(x - y) for x, y in zip(a, b)))
        scores = [sum(t < GOOD_BELOW for t in ts) / len(ts) for ts in tokens]
        mean = sum(scores) / len(scores)
        rewards.append(mean)
        advantages = [s - mean for s in scores]
        datums = [is_datum(PROMPT, t, lp, a) for t, lp, a in zip(tokens, sampled, advantages)]
        fb = policy.forward_backward(datums, "importance_sampling").result()
        report.setdefault("fb_metrics", []).append(dict(fb.metrics))
        policy.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        before.append(surrogate(trainer, advantages))
        after.append(surrogate(completion_logprobs(policy, PROMPT, tokens), advantages))

    final = policy.save_weights_for_sampler("final").result().path
    report.update(paths=paths, final=final, max_gap=max(gaps), loss_before=before)
    report.update(loss_after=after, rewards=rewards)

    # a standalone sampler: a service that trained nothing samples the final checkpoint
    if hasattr(service, "_bind_standalone_sampler_route"):
        other = FiretitanServiceClient(base_url=base_url, api_key=key)
        sampler = other.create_sampling_client(model_path=final, tokenizer=tokenizer)
        report["standalone_model"] = sampler.get_base_model()
        one = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, params).result().sequences[0]
        lps = completion_logprobs(policy, PROMPT, [list(one.tokens)])[0]
        report["standalone_gap"] = max(abs(x - y) for x, y in zip(one.logprobs, lps))
        sampler.close()

    # resume by the path `save_state` returned (`weights_info`, then `load_state_with_optimizer`
    # on a new run), the way the cookbook's DPO example resumes; then one more identical step on
    # both, which agrees only if the optimizer's moments came back with the weights
    state = policy.save_state("resume-1").result().path
    resumed = service.create_training_client_from_state_with_optimizer(state)
    report.update(state=state, resumed_run=resumed.run_id)
    report["resume_gap"] = max_gap(policy, resumed, probe)
    for trained in (policy, resumed):
        trained.forward_backward([ce_datum(probe)], "cross_entropy").result()
        trained.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    report["resume_step_gap"] = max_gap(policy, resumed, probe)
    elsewhere = FiretitanServiceClient(base_url=base_url, api_key=key)  # one trainer a service
    fresh = elsewhere.create_lora_training_client(base_model, rank=4, seed=0)
    fresh.load_state(state).result()  # weights alone: a fresh optimizer
    fresh.forward_backward([ce_datum(probe)], "cross_entropy").result()
    fresh.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    report["fresh_optimizer_gap"] = max_gap(policy, fresh, probe)

    try:
        service.create_training_client(base_model=base_model, lora_rank=0)
        report["full_parameter"] = "accepted"
    except Exception as exc:  # the surface's 400, as the SDK raises it
        report["full_parameter"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(report))


if __name__ == "__main__":
    main()
