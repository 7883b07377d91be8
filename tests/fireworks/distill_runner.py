"""Run the Fireworks training cookbook's serverless distillation example,
`training/examples/distillation/serverless_k3_privileged/train_serverless_k3_privileged.py`,
unchanged, against the worker at `FIREWORKS_BASE_URL` (its `Config` reads the URL and
`FIREWORKS_API_KEY` itself).

Executed by the cookbook venv's python with the exported cookbook tree on `sys.path`, as
`countdown_runner.py` is. The example's own data (its bundled GSM8K rows) is used; only its
`Config` is filled for a tiny local model: the tokenizer directory and the `qwen3_instruct`
renderer (the example's default renders Kimi K3 prompts), a small rank, short rollouts, few
steps.

Usage: python distill_runner.py SPEC_JSON   (keys: cookbook, base_model, tokenizer, run_dir,
steps, prompt_groups, group_size, max_completion_tokens, learning_rate)

Prints one JSON line last: `metrics` (the example's metrics.jsonl) and `checkpoints` (its
checkpoints.json); on failure `error` and `traceback` too, and exits 1.
"""

from __future__ import annotations

import json
import logging
import sys
import traceback
from pathlib import Path
from typing import Any


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    sys.path.insert(0, spec["cookbook"])
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    run_dir = Path(spec["run_dir"])
    out: dict[str, Any] = {}
    try:
        from training.examples.distillation.serverless_k3_privileged import (
            train_serverless_k3_privileged as example,
        )

        config = example.Config(
            base_model=spec["base_model"],
            tokenizer_model=spec["tokenizer"],
            renderer_name="qwen3_instruct",
            lora_rank=4,
            max_seq_len=1024,
            steps=spec["steps"],
            prompt_groups_per_step=spec["prompt_groups"],
            completions_per_prompt=spec["group_size"],
            prompt_concurrency=2,
            max_completion_tokens=spec["max_completion_tokens"],
            learning_rate=spec["learning_rate"],
            sampling_timeout_s=300.0,
            run_dir=str(run_dir),
        )
        example.ServerlessK3PrivilegedDistillation(config).run()
    except BaseException as exc:  # SystemExit too
        out.update(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    out["metrics"] = [json.loads(line) for line in lines if line.strip()]
    checkpoints = run_dir / "checkpoints.json"
    out["checkpoints"] = json.loads(checkpoints.read_text()) if checkpoints.exists() else None
    print(json.dumps(out, default=str), flush=True)
    return 1 if "error" in out else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
