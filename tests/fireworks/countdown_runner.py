"""Run the Fireworks training cookbook's serverless RL example,
`training/examples/serverless_rl/countdown_rl.py`, unchanged, against the worker at
`FIREWORKS_BASE_URL` (its `Config` reads the URL and `FIREWORKS_API_KEY` itself).

Executed by the cookbook venv's python (`tests/fireworks/cookbook_venv.py`) with the exported
cookbook tree on `sys.path` (it imports as `training`). The example's own data set is used (the
32 Countdown rows bundled beside it: nothing is downloaded); only its `Config` is filled for a
tiny local model: the tokenizer directory and the `qwen3_instruct` renderer (the example infers
one from a hub name otherwise), a small rank, short rollouts and few steps, no plot. One
client-side shim: the pinned `tinker` 0.23.0 is taught the example's `mask` key
(`allow_mask_key`), which it would refuse before any request is sent.

Usage: python countdown_runner.py SPEC_JSON   (keys: cookbook, base_model, tokenizer, run_dir,
steps, group_size, prompt_groups, max_sample_tokens, max_seq_len, learning_rate)

Prints one JSON line: `records` (the example's per-step records), `metrics` (its
metrics.jsonl) and `calls` (the HTTP requests the SDK made, `METHOD URL STATUS`); on failure
`error` and `traceback` instead of `records`, and exits 1.
"""

from __future__ import annotations

import json
import logging
import sys
import traceback
from pathlib import Path
from typing import Any


class CallLog(logging.Handler):
    """The SDK's HTTP calls, from httpx's own request log lines."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.calls: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("HTTP Request: "):
            self.calls.append(message.removeprefix("HTTP Request: "))


def allow_mask_key() -> None:
    """Let the pinned `tinker` 0.23.0 build the example's datums.

    The example puts a client-side action `mask` (a list of floats) into each datum's
    `loss_fn_inputs` and strips it before `forward_backward` (`_remove_mask`), so it never
    reaches the SDK or the worker. `tinker` 0.23.0, which `fireworks-ai[training]` 1.2.9 to
    1.2.30 pin, knows no dtype for that key and raises `KeyError: 'mask'` while building the
    datum (0.38 knows it as float32). This gives the key that dtype and changes nothing else.
    """
    from tinker.types import datum

    datum._KEY_TO_TYPE.setdefault("mask", "float32")


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    sys.path.insert(0, spec["cookbook"])
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    calls = CallLog()
    logging.getLogger("httpx").addHandler(calls)
    run_dir = Path(spec["run_dir"])
    out: dict[str, Any] = {}
    try:
        allow_mask_key()
        from training.examples.serverless_rl import countdown_rl as example

        logging.getLogger("httpx").setLevel(logging.INFO)
        config = example.Config(
            base_model=spec["base_model"],
            tokenizer_model=spec["tokenizer"],
            renderer_name="qwen3_instruct",
            lora_rank=4,
            max_seq_len=spec["max_seq_len"],
            steps=spec["steps"],
            prompt_groups_per_step=spec["prompt_groups"],
            group_size=spec["group_size"],
            prompt_concurrency=2,
            max_sample_tokens=spec["max_sample_tokens"],
            learning_rate=spec["learning_rate"],
            sampling_timeout_s=300.0,
            run_dir=str(run_dir),
            plot_reward_curve=False,
        )
        out["records"] = example.ServerlessCountdownRL(config).run()
    except BaseException as exc:  # SystemExit too
        out.update(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    out["metrics"] = [json.loads(line) for line in lines if line.strip()]
    out["calls"] = calls.calls
    print(json.dumps(out, default=str), flush=True)
    return 1 if "error" in out else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
