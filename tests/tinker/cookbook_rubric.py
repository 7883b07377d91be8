"""`recipes/rubric/train.py` as `python -m` runs it, on data its own `generate_data.py` writes
(run by `cookbook_runner.py` in the tinker venv).

The recipe reads two JSONL files (`train_jsonl_path`, `test_jsonl_path`) that its README has
the user generate first; this writes a few datapoints of the recipe's own generator under
`LOG_PATH-data` (beside the log folder, which the recipe wants new) and runs the recipe's
`__main__` with those paths added to its command line.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

from tinker_cookbook.recipes.rubric.generate_data import generate_dataset


def main() -> None:
    runs = Path(os.environ["TINKER_COOKBOOK_RUNS_DIR"])
    data = runs.with_name(f"{runs.name}-data")
    data.mkdir(parents=True, exist_ok=True)
    train, test = generate_dataset(num_train=8, num_test=2, seed=42, write_dir=str(data))
    sys.argv = [*sys.argv, f"train_jsonl_path={train}", f"test_jsonl_path={test}"]
    runpy.run_module("tinker_cookbook.recipes.rubric.train", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
