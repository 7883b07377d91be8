"""Per-step overhead of a Tinker RL loop's sampler: `save_weights_and_get_sampling_client` and
the first sample after it, through the official `tinker` SDK (the tests' cached venv).

    python scripts/bench_tinker_steps.py --steps 10                       # in-process sampling
    python scripts/bench_tinker_steps.py --steps 10 --vllm-python PY      # vLLM replicas

A worker in this process on a tiny Qwen3 with a tokenizer (`tests/vllm/test_tinker.py`'s), the
SDK loop of `tests/vllm/tinker_rl.py` (save for the sampler, sample 4 x 6 tokens,
compute_logprobs, forward, one importance-sampling step) run `--steps` times; medians over the
steps after the first of the sampler's creation and of the sample. Run it from two trees to
compare them (PYTHONPATH set to each).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # after PYTHONPATH: another tree's `trainer` and `tests` come first

from tests.api.conftest import serve_in_thread  # noqa: E402
from tests.tinker.conftest import VOCAB, build_tokenizer, run_in_venv  # noqa: E402
from tests.tinker.venv import tinker_python  # noqa: E402
from trainer.tiny import TinySpec, save_model  # noqa: E402

BASE = "Qwen/Qwen3-8B"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--vllm-python", help="sample on vLLM replicas in this interpreter")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-tinker-"))
    spec = TinySpec(vocab=len(VOCAB), head_dim=32, tied=True, bos=None, eos=1, pad=0, scale=4.0)
    model = build_tokenizer(save_model(spec, root / "model"))
    settings: dict = {"model": [{"name": BASE, "location": str(model)}]}
    if args.vllm_python:
        settings["generator"] = {"backend": "vllm", "python": args.vllm_python}
        settings["resource_create_wait_s"] = 120
    script = ROOT / "tests" / "vllm" / "tinker_rl.py"
    with serve_in_thread(root / "storage", {}, **settings) as server:
        out = run_in_venv(tinker_python(), server, [str(script), BASE, str(args.steps)], 1800)
        opened = getattr(server.app.state.tinker_samplers, "opened", None)  # None: not counted
    steps = out["steps"][1:]
    sampler = statistics.median(s["seconds"]["sampler"] for s in steps)
    sample = statistics.median(s["seconds"]["sample"] for s in steps)
    print(
        json.dumps(
            {
                "backend": "vllm" if args.vllm_python else "hf",
                "steps": args.steps,
                "sampler_s": round(sampler, 4),
                "first_sample_s": round(sample, 4),
                "sampler_plus_sample_s": round(sampler + sample, 4),
                "engine_sessions_opened_for_samplers": opened,
            }
        )
    )


if __name__ == "__main__":
    main()
