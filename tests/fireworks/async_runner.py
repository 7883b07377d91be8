"""Run one of the Fireworks training cookbook's async RL recipes, unchanged, against the worker
at `FIREWORKS_BASE_URL` (the recipes read it and `FIREWORKS_API_KEY` themselves): the
serverless one, `training/recipes/experiment/async_rl_loop_serverless.py` (`recipe:
"serverless"`, the default), or `training/recipes/async_rl_loop.py` (`recipe: "deployment"`: a
trainer job and a deployment hot-loaded with each version).

Executed by the cookbook venv's python with the exported cookbook tree on `sys.path`, as
`countdown_runner.py` is. The recipe takes its rollout function from the caller; this one
(`make_rollout_fn`) samples token prompts through the recipe's own sampler (the cookbook's
`build_deployment_sampler`: the serverless snapshot sampler, or the deployment's) and packs them
with the cookbook's helper. (The token-in example `examples/rl/single_turn_token_in` is written for
the deployment recipe: it keeps no raw logprobs, which the serverless recipe requires.)

Usage: python async_runner.py SPEC_JSON   (keys: cookbook, base_model, tokenizer, run_dir,
rows, group_size, max_completion_tokens, learning_rate, dcp_save_interval; recipe, lora_rank;
for a serverless resume init_from_checkpoint, step_offset, resolved_rows_offset)

Prints one JSON line last: `result` (what the recipe's `main` returns) and `metrics` (its
metrics file); on failure `error` and `traceback` instead of `result`, and exits 1.
"""

from __future__ import annotations

import json
import logging
import sys
import traceback
from pathlib import Path
from typing import Any

PROMPT = [10, 11, 12, 13]
GOOD_BELOW = 20


def make_rollout_fn(setup: Any) -> Any:
    """A token-in rollout as the cookbook's serverless examples write one: one completion
    from the recipe's sampler (`setup.sampler`, the current snapshot) with the recipe's sample
    arguments, packed by the cookbook's `sampled_completion_to_rollout_run` (tokens, sampling
    and raw logprobs, loss mask), rewarded by the share of its tokens below `GOOD_BELOW`, plus
    a tie-break under 1e-3 from its tokens."""
    from training.examples.rl.vanilla_sampler import build_deployment_sampler
    from training.utils.rl.rollout.renderer import sampled_completion_to_rollout_run

    sampler = build_deployment_sampler(setup)

    async def rollout_fn(row: dict[str, Any]) -> Any:
        prompt = list(row["prompt_token_ids"])
        [completion] = await sampler.sample_with_prompt_tokens(prompt, n=1, **setup.sample_kwargs)
        out = list(completion.full_tokens)[int(completion.prompt_len) :]
        reward = sum(t < GOOD_BELOW for t in out) / max(1, len(out))
        # a tie-break below any share's step: a group whose shares tie (1 in 300 when
        # measured) would have no advantage, so no gradient; now only identical ones tie
        reward += 1e-3 * (sum((i + 1) * t for i, t in enumerate(out)) % 997) / 997
        return sampled_completion_to_rollout_run(completion, reward=reward)

    return rollout_fn


def build_config(spec: dict[str, Any], metrics: Path) -> tuple[Any, Any]:
    """The recipe module and its `Config`: its defaults but the loop's size and what a local
    run must say (the tokenizer directory; for a deployment, a shape: any string)."""
    common: dict[str, Any] = {
        "base_model": spec["base_model"],
        "learning_rate": spec["learning_rate"],
        "completions_per_prompt": spec["group_size"],
        "min_group_size": spec["group_size"],
        "prompt_groups_per_step": 1,
        "pipeline_chunks_per_step": 1,
        "max_completion_tokens": spec["max_completion_tokens"],
        "max_seq_len": 512,
        "dcp_save_interval": spec["dcp_save_interval"],
    }
    if spec.get("recipe", "serverless") == "deployment":
        import os

        from training.recipes import async_rl_loop as recipe
        from training.utils import DeployConfig

        os.environ["COOKBOOK_METRICS_FILE"] = str(metrics)
        deployment = DeployConfig(
            deployment_shape="accounts/local/deploymentShapes/tiny",
            tokenizer_model=spec["tokenizer"],
        )
        log_path = metrics.parent / "logs"
        log_path.mkdir(exist_ok=True)
        config = recipe.Config(
            log_path=str(log_path),
            lora_rank=spec.get("lora_rank", 4),
            deployment=deployment,
            **common,
        )
        return recipe, config

    from training.recipes.experiment import async_rl_loop_serverless as serverless

    config = serverless.Config(
        tokenizer_model=spec["tokenizer"],
        lora_rank=4,
        sample_timeout=300.0,
        metrics_file=str(metrics),
        init_from_checkpoint=spec.get("init_from_checkpoint"),
        step_offset=spec.get("step_offset", 0),
        resolved_rows_offset=spec.get("resolved_rows_offset", 0),
        **common,
    )
    return serverless, config


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    sys.path.insert(0, spec["cookbook"])
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    run_dir = Path(spec["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics = run_dir / "metrics.jsonl"
    out: dict[str, Any] = {}
    try:
        recipe, config = build_config(spec, metrics)
        rows = [{"id": f"row-{i}", "prompt_token_ids": PROMPT} for i in range(spec["rows"])]
        out["result"] = recipe.main(config, rollout_fn_factory=make_rollout_fn, rows=rows)
    except BaseException as exc:  # SystemExit too
        out.update(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    out["metrics"] = [json.loads(line) for line in lines if line.strip()]
    print(json.dumps(out, default=str), flush=True)
    return 1 if "error" in out else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
