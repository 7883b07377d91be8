"""Run the Fireworks training cookbook's serverless DPO example,
`training/examples/serverless_dpo/ultrafeedback_dpo.py`, unchanged, against the worker at
`FIREWORKS_BASE_URL` (its `Config` reads the URL and `FIREWORKS_API_KEY` itself).

Executed by the cookbook venv's python with the exported cookbook tree on `sys.path`, as
`countdown_runner.py` is. Only the example's `Config` is filled: a preference JSONL the test
wrote (the example's own data needs a download), the tokenizer directory and the
`qwen3_instruct` renderer, a small rank, few steps, no plot. `resume_from` in the spec resumes
an earlier run's checkpoint, as the example's `--resume-from` does.

Usage: python dpo_runner.py SPEC_JSON   (keys: cookbook, base_model, tokenizer, dataset,
run_dir, steps, batch_size, learning_rate, dcp_save_interval, eval_pairs, resume_from)

Prints one JSON line last: `records` (the example's per-step records) and `calls` (the HTTP
requests the SDK made, `METHOD URL STATUS`); on failure `error` and `traceback` instead of
`records`, and exits 1.
"""

from __future__ import annotations

import json
import logging
import sys
import traceback
from typing import Any

from countdown_runner import CallLog


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    sys.path.insert(0, spec["cookbook"])
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    calls = CallLog()
    logging.getLogger("httpx").addHandler(calls)
    logging.getLogger("httpx").setLevel(logging.INFO)
    out: dict[str, Any] = {}
    try:
        from training.examples.serverless_dpo import ultrafeedback_dpo as example

        config = example.Config(
            base_model=spec["base_model"],
            tokenizer_model=spec["tokenizer"],
            renderer_name="qwen3_instruct",
            dataset=spec["dataset"],
            lora_rank=4,
            max_seq_len=512,
            steps=spec["steps"],
            batch_size=spec["batch_size"],
            learning_rate=spec["learning_rate"],
            ref_concurrency=2,
            dcp_save_interval=spec["dcp_save_interval"],
            eval_pairs=spec["eval_pairs"],
            resume_from=spec.get("resume_from", ""),
            run_dir=spec["run_dir"],
            plot_metrics=False,
        )
        out["records"] = example.main(config)
    except BaseException as exc:  # SystemExit too
        out.update(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
    out["calls"] = calls.calls
    print(json.dumps(out, default=str), flush=True)
    return 1 if "error" in out else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
