"""Benchmarks of the engine against naive baselines and TRL (`scripts/bench.py`).

- `harness`: timing, peak memory, and running one arm in a fresh subprocess;
- `shapes`: the Qwen3-shaped random models and the mixed-length batches;
- `arms_*`: the measured code paths, one function per arm, registered in `arms.ARMS`;
- `rows`: the engine's comparisons (which arms, which ratios, which targets);
- `report`: the table, the machine, and the `BENCHMARKS.md` section.
"""
