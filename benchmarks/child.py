"""`python -m benchmarks.child ARM PARAMS_JSON`: run one arm, print its measurement."""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main() -> None:
    from benchmarks.arms import run_inprocess
    from benchmarks.harness import RESULT_PREFIX

    result = run_inprocess(sys.argv[1], json.loads(sys.argv[2]))
    print(RESULT_PREFIX + json.dumps(result.to_json()), flush=True)


if __name__ == "__main__":
    main()
