"""The engine's benchmarks: the engine against naive baselines and TRL's GRPOTrainer.

    python scripts/bench.py                 # every row, writes BENCHMARKS.md (7-13 min, 2 cores)
    python scripts/bench.py --rows 1,2      # some rows only
    python scripts/bench.py --quick         # tiny shapes, in-process: a smoke check (seconds)

Each comparison runs its arms in fresh subprocesses (clean peak memory), prints one table,
and, unless `--quick` or `--no-write`, writes it between the `bench` markers of BENCHMARKS.md
with the command, the machine and the versions. Also callable as `main(argv)`
(`benchmarks.main.main`). `--save-json F` keeps the results;
`--from-json F` re-renders them without measuring.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.main import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
