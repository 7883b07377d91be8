"""What a large request body costs the worker: the old parse against the new.

    python scripts/bench_bodies.py                  # 6, 60, 300 MB, 3 runs each; BENCHMARKS.md
    python scripts/bench_bodies.py --sizes 6 --repeats 1 --no-write    # a quick check
    git archive <base> | tar -x -C OLD      # the old code, for the worst shapes on both faces:
    python scripts/bench_bodies.py --sizes '' --hostile-sizes 1,8,60 --old-tree OLD

See `benchmarks/bodies.py` for what is measured and how.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bodies import main

if __name__ == "__main__":
    raise SystemExit(main())
