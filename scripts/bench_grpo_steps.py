"""A GRPO step through the Fireworks training SDK (deployment, hot-load, completions) against
the same step through the `tinker` SDK (sampling client, `asample`), on one worker, in one run.

    python scripts/bench_grpo_steps.py --rounds 3 --steps 5

A worker in this process serves a tiny Qwen3 at init scale (`tests/tinker/conftest.py`'s
builder). Each round runs both arms one after the other, in their own venvs:
`benchmarks/sdk_steps/fireworks_grpo.py` (a LoRA trainer job, a deployment, `WeightSyncer`,
`DeploymentSampler`) and `benchmarks/sdk_steps/tinker_grpo.py` (a LoRA `TrainingClient` and
its sampling clients). A step is: sample `--group` completions of `--tokens` tokens of one
prompt, the policy's `forward`, `forward_backward_custom` with a policy-gradient loss,
`optim_step`, and publishing the new weights to the sampler. Reported: the median step of each
arm (the first step of each round left out), their ratio, and the median of two phases of a
step: sampling, and publishing the new weights (save + hot-load; save + new sampling client).
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
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-grpo-"))
    model = build_served_model(root / "model", scale=1.0, seed=0, tokenizer_dir=root / "model")
    shape = [str(args.steps), str(args.group), str(args.tokens)]
    arms: dict[str, list[float]] = {"fireworks": [], "tinker": []}
    phases: dict[str, list[list[float]]] = {"fireworks": [], "tinker": []}
    fw, tk = fireworks_python(), tinker_python()
    with serve_in_thread(root / "storage", {QWEN: model}) as server:
        for _ in range(args.rounds):
            out = run_in_venv(tk, server, [str(STEPS / "tinker_grpo.py"), QWEN, *shape], 1800)
            arms["tinker"] += out["seconds"][1:]
            phases["tinker"] += out["phases"][1:]
            argv = [str(STEPS / "fireworks_grpo.py"), QWEN, *shape, str(model)]
            out = run_fw(fw, server, argv, 1800)
            arms["fireworks"] += out["seconds"][1:]
            phases["fireworks"] += out["phases"][1:]
    medians = {arm: statistics.median(times) for arm, times in arms.items()}
    print(
        json.dumps(
            {
                "rounds": args.rounds,
                "steps": args.steps,
                "group": args.group,
                "tokens": args.tokens,
                "median_step_s": {arm: round(s, 4) for arm, s in medians.items()},
                "fireworks_over_tinker": round(medians["fireworks"] / medians["tinker"], 3),
                "median_sample_s": {
                    a: round(statistics.median(p[0] for p in v), 4) for a, v in phases.items()
                },
                "median_publish_s": {
                    a: round(statistics.median(p[1] for p in v), 4) for a, v in phases.items()
                },
            }
        )
    )


if __name__ == "__main__":
    main()
