"""A trainer-job step through the Fireworks training SDK against the same step through the
`tinker` SDK, on one worker, in one run.

    python scripts/bench_fireworks_steps.py --rounds 3 --steps 6

A worker in this process serves a tiny Qwen3 (`tests/fireworks/conftest.py`'s). Each round runs
both arms one after the other, in their own venvs (`tests/fireworks/venv.py`,
`tests/tinker/venv.py`): `benchmarks/sdk_steps/fireworks_steps.py` (a LoRA trainer job made by
`TrainerJobManager.create_and_wait`, its `FiretitanTrainingClient` through the job's gateway)
and `benchmarks/sdk_steps/tinker_steps.py` (a LoRA `TrainingClient` on the Tinker face). A step
is one cross-entropy `forward_backward` of `--batch` datums of `--tokens` tokens and one
`optim_step`, each waited for. Reported: the median step of each arm (the first step of each
round left out) and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.api.conftest import serve_in_thread  # noqa: E402
from tests.fireworks.conftest import QWEN, run_fw  # noqa: E402
from tests.fireworks.venv import fireworks_python  # noqa: E402
from tests.tinker.conftest import build_served_model, run_in_venv  # noqa: E402
from tests.tinker.venv import tinker_python  # noqa: E402

STEPS = ROOT / "benchmarks" / "sdk_steps"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-fireworks-"))
    model = build_served_model(root / "model", scale=8.0, seed=0, tokenizer_dir=root / "model")
    shape = [str(args.steps), str(args.batch), str(args.tokens)]
    arms: dict[str, list[float]] = {"fireworks": [], "tinker": []}
    fw, tk = fireworks_python(), tinker_python()
    with serve_in_thread(root / "storage", {QWEN: model}) as server:
        for _ in range(args.rounds):
            out = run_in_venv(tk, server, [str(STEPS / "tinker_steps.py"), QWEN, *shape], 1800)
            arms["tinker"] += out["seconds"][1:]
            out = run_fw(fw, server, [str(STEPS / "fireworks_steps.py"), QWEN, *shape], 1800)
            arms["fireworks"] += out["seconds"][1:]
    medians = {arm: statistics.median(times) for arm, times in arms.items()}
    print(
        json.dumps(
            {
                "rounds": args.rounds,
                "steps": args.steps,
                "batch": args.batch,
                "tokens": args.tokens,
                "median_step_s": {arm: round(s, 4) for arm, s in medians.items()},
                "fireworks_over_tinker": round(medians["fireworks"] / medians["tinker"], 3),
            }
        )
    )


if __name__ == "__main__":
    main()
