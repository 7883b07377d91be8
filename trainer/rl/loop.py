"""The GRPO loop (and its cross-entropy twin), one readable function per stage.

Design notes: `docs/design/rl.md`.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from trainer.rl.advantages import batch_advantages, is_degenerate, position_advantages
from trainer.rl.client import BACKGROUND_PUBLISH, SYNCHRONOUS, Completion, PolicyClient
from trainer.rl.config import Recipe
from trainer.rl.tasks import Problem, Task


@dataclass
class Batch:
    """Problems and their sampled groups (P prompts x G completions)."""

    problems: list[Problem]
    groups: list[list[Completion]]


# --------------------------------------------------------------------------------------------
# Samples on the wire (alignment: model_input = (prompt + completion)[:-1], targets shifted)
# --------------------------------------------------------------------------------------------


def _tensor(values: list[Any], dtype: str) -> dict[str, Any]:
    return {"data": values, "dtype": dtype}


def grpo_sample(prompt: list[int], completion: Completion, advantages_T: list[float]) -> dict:
    """A GRPO sample: only the completion's tokens are trained (mask 1), the prompt's are not.

    Position i of `model_input` predicts token i+1 of prompt + completion, so the completion's
    tokens are the targets at positions len(prompt)-1 .. end.
    """
    if len(advantages_T) != len(completion.tokens) or len(completion.logprobs) != len(
        completion.tokens
    ):
        raise ValueError("one advantage and one sampler logprob per completion token")
    tokens = prompt + completion.tokens
    pad = len(prompt) - 1
    return {
        "model_input": {"chunks": [{"encoded_text": {"tokens": tokens[:-1]}}]},
        "loss_fn_inputs": {
            "target_tokens": _tensor(tokens[1:], "int64"),
            "logprobs": _tensor([0.0] * pad + completion.logprobs, "float32"),
            "advantages": _tensor([0.0] * pad + advantages_T, "float32"),
            "mask": _tensor([0.0] * pad + [1.0] * len(completion.tokens), "float32"),
        },
    }


def sft_sample(prompt: list[int], answer: list[int]) -> dict:
    """A cross-entropy sample: weight 1 on the answer's tokens, 0 on the prompt's."""
    tokens = prompt + answer
    pad = len(prompt) - 1
    return {
        "model_input": {"chunks": [{"encoded_text": {"tokens": tokens[:-1]}}]},
        "loss_fn_inputs": {
            "target_tokens": _tensor(tokens[1:], "int64"),
            "weights": _tensor([0.0] * pad + [1.0] * len(answer), "float32"),
        },
    }


# --------------------------------------------------------------------------------------------
# Rewards → advantages → samples
# --------------------------------------------------------------------------------------------


@dataclass
class Scored:
    samples: list[dict]  # what forward-backward trains on
    rewards_P_G: list[list[float]]
    skipped_groups: int  # groups with all-equal rewards (no signal)


def score_batch(batch: Batch, task: Task, recipe: Recipe) -> Scored:
    """Reward every completion, turn rewards into advantages, build the training samples."""
    loop = recipe.loop
    rewards_P_G = [
        [task.score(problem, c.tokens) for c in group]
        for problem, group in zip(batch.problems, batch.groups, strict=True)
    ]
    if loop.objective == "sft":
        references = [sft_sample(problem.prompt, problem.answer) for problem in batch.problems]
        return Scored(references, rewards_P_G, 0)
    samples: list[dict] = []
    skipped = 0
    per_token = loop.per_token_advantages
    advantages_P_G = batch_advantages(rewards_P_G, loop.scale_by_std)
    for p, (problem, group) in enumerate(zip(batch.problems, batch.groups, strict=True)):
        scores = [task.token_scores(problem, c.tokens) for c in group] if per_token else []
        if scores and all(s is not None for s in scores):
            token_adv = position_advantages([s or [] for s in scores], loop.scale_by_std)
        else:  # sequence-level GRPO: the completion's advantage on each of its tokens
            token_adv = [[a] * len(c.tokens) for a, c in zip(advantages_P_G[p], group, strict=True)]
        if is_degenerate(token_adv):
            skipped += 1
            continue
        for completion, adv in zip(group, token_adv, strict=True):
            if completion.tokens:
                samples.append(grpo_sample(problem.prompt, completion, adv))
    return Scored(samples, rewards_P_G, skipped)


def loss_config(recipe: Recipe) -> dict[str, Any]:
    if recipe.loop.objective == "sft":
        return {"type": "LOSS_TYPE_CROSS_ENTROPY", "cross_entropy_params": {}}
    g = recipe.grpo
    return {
        "type": "LOSS_TYPE_GRPO",
        "grpo_params": {
            "clip_low_threshold": g.clip_low_threshold,
            "clip_high_threshold": g.clip_high_threshold,
            "beta": 0.0,
            "agg_type": f"GRPO_LOSS_AGGREGATION_TYPE_{g.agg_type}",
            "ratio_type": f"GRPO_LOSS_RATIO_TYPE_{g.ratio_type}",
        },
    }


def optim_params(recipe: Recipe, lr: float) -> dict[str, Any]:
    """The optim-step body for the resource's optimizer: `adam_params`, or `muon_params` with
    the same learning rate on both sides (MATCH_ADAM carries Adam's rates over)."""
    loop = recipe.loop
    adam = {"learning_rate": lr, "beta1": 0.9, "beta2": loop.beta2}
    adam["weight_decay"] = loop.weight_decay
    if recipe.resource.optimizer == "adam":
        return {"adam_params": {**adam, "grad_clip_norm": loop.grad_clip_norm}}
    muon = {"learning_rate": lr, "momentum": loop.muon_momentum, "weight_decay": loop.weight_decay}
    return {"muon_params": {**muon, "grad_clip_norm": loop.grad_clip_norm, "adam": adam}}


def learning_rate(recipe: Recipe, step: int) -> float:
    loop = recipe.loop
    if loop.lr_warmup_steps and step < loop.lr_warmup_steps:
        return loop.learning_rate * (step + 1) / loop.lr_warmup_steps
    return loop.learning_rate


def sampler_kl(samples: list[dict], outputs: list[dict] | None) -> float:
    """Mean k3 estimate of KL(sampler ‖ trainer) over trained tokens, from the logprobs the
    forward-backward returned: ~0 on-policy (same weights), > 0 when samples are stale."""
    if not outputs:
        return 0.0
    total, count = 0.0, 0
    for sample, out in zip(samples, outputs, strict=True):
        inputs = sample["loss_fn_inputs"]
        q_T = inputs.get("logprobs", {}).get("data")
        mask_T = inputs.get("mask", inputs.get("weights", {})).get("data")
        lp_T = out["tensors"]["logprobs"]["data"]
        if q_T is None:
            return 0.0
        for q, m, lp in zip(q_T, mask_T, lp_T, strict=True):
            if m:
                d = q - lp  # log(π_sampler / π_trainer)
                total += math.exp(-d) - 1.0 + d  # k3 = r - 1 - log r with r = π_θ / π_old
                count += 1
    return total / max(1, count)


# --------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------


def _mean_std(values: list[float]) -> tuple[float, float]:
    if not values:
        return 0.0, 0.0
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


class RLLoop:
    """Drives a `PolicyClient` through `recipe.loop.steps` steps; one metrics dict per step."""

    def __init__(self, client: PolicyClient, task: Task, recipe: Recipe) -> None:
        self.client = client
        self.task = task
        self.recipe = recipe
        self.rng = random.Random(recipe.seed)
        self.trainer_version = 0  # policy version of the trained weights (optim-steps done)
        self.max_tokens = recipe.sampling.max_tokens or task.max_tokens

    def sampling_params(self, step: int) -> dict[str, Any]:
        s = self.recipe.sampling
        return {
            "max_tokens": self.max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "seed": self.recipe.seed * 1_000_003 + step,
        }

    @property
    def group_size(self) -> int:
        return 1 if self.recipe.loop.objective == "sft" else self.recipe.loop.group_size

    def _submit(self, step: int) -> tuple[list[Problem], Future[list[list[Completion]]]]:
        problems = self.task.problems(self.recipe.loop.prompts_per_step, self.rng)
        prompts = [p.prompt for p in problems]
        future = self.client.submit_sample(prompts, self.group_size, self.sampling_params(step))
        return problems, future

    def run(self, on_step: Callable[[dict[str, Any]], None] | None = None) -> list[dict]:
        off_policy = self.recipe.loop.mode == "off_policy"
        steps = self.recipe.loop.steps
        history: list[dict[str, Any]] = []
        pending: tuple[list[Problem], Future[list[list[Completion]]]] | None = None
        for step in range(steps):
            start = time.perf_counter()
            # on-policy: sampled now, after the previous step's SYNCHRONOUS sync
            problems, future = pending or self._submit(step)
            batch = Batch(problems, future.result())
            pending = None
            if off_policy and step + 1 < steps:
                pending = self._submit(step + 1)  # queued before this batch trains
            metrics = self.train_step(step, batch)
            elapsed = time.perf_counter() - start
            metrics["tokens_per_s"] = metrics.pop("tokens") / max(elapsed, 1e-9)
            metrics["time/step_s"] = elapsed
            history.append(metrics)
            if on_step is not None:
                on_step(metrics)
        return history

    def train_step(self, step: int, batch: Batch) -> dict[str, Any]:
        recipe = self.recipe
        scored = score_batch(batch, self.task, recipe)
        sync = BACKGROUND_PUBLISH if recipe.loop.mode == "off_policy" else SYNCHRONOUS
        fb: dict[str, Any] = {"loss": 0.0, "metrics": {}}
        kl = 0.0
        if scored.samples:
            with_logprobs = recipe.loop.objective == "grpo"  # for the sampler/trainer KL
            fb = self.client.forward_backward(scored.samples, loss_config(recipe), with_logprobs)
            kl = sampler_kl(scored.samples, fb.get("loss_fn_outputs"))
        sampled_version = min(c.version for group in batch.groups for c in group)
        staleness = self.trainer_version - sampled_version  # versions between sampler/trainer
        lr = learning_rate(recipe, step)
        opt = self.client.optim_step(optim_params(recipe, lr))
        self.trainer_version += 1
        version = self.client.weights_sync(sync)
        rewards = [r for group in scored.rewards_P_G for r in group]
        reward_mean, reward_std = _mean_std(rewards)
        trained_tokens = sum(
            len(s["loss_fn_inputs"]["target_tokens"]["data"]) for s in scored.samples
        )
        sampled_tokens = sum(len(c.tokens) for group in batch.groups for c in group)
        opt_metrics = opt.get("metrics") or {}
        metrics: dict[str, Any] = {
            "step": step + 1,
            "reward/mean": reward_mean,
            "reward/std": reward_std,
            "loss": float(fb["loss"]),
            "kl": kl,
            "grad_norm": float(opt_metrics.get("grad_norm", 0.0)),
            "tokens": trained_tokens + sampled_tokens,  # → tokens_per_s in `run`
            "weights_version": version,
            "learning_rate": lr,
            "samples": len(scored.samples),
            "groups/skipped": scored.skipped_groups,
            "completion/length": sampled_tokens / max(1, sum(map(len, batch.groups))),
            "version/sampled_min": sampled_version,  # oldest policy in the batch
            "version/staleness": staleness,
        }
        for key, value in (fb.get("metrics") or {}).items():
            metrics[key if key.startswith("loss/") else f"loss/{key}"] = float(value)
        return metrics

    def evaluate(self, n: int) -> float:
        """Greedy reward (temperature 0) on `n` fresh prompts, at the published weights."""
        if n <= 0:
            return float("nan")
        problems = self.task.problems(n, random.Random(self.recipe.seed + 10_007))
        groups = self.client.sample(
            [p.prompt for p in problems], 1, {"max_tokens": self.max_tokens, "temperature": 0.0}
        )
        scores = [self.task.score(p, g[0].tokens) for p, g in zip(problems, groups, strict=True)]
        return sum(scores) / len(scores)
