"""The GPU proof script rehearsed on the CPU (`bash scripts/gpu_proof.sh --rehearse`).

The script runs once a GPU machine is lent, with minutes to spare; this keeps it from rotting
between those times: every step runs (tiny shapes, the GPU-only ones skipped or collected only)
and its figures are the numbers they claim to be.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_rehearsal_runs_every_step(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}  # this suite's own
    done = subprocess.run(
        ["bash", "scripts/gpu_proof.sh", "--rehearse"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    report = json.loads((tmp_path / "figures.json").read_text())
    steps = report["steps"]
    broken = {n: s.get("log_tail", "")[-800:] for n, s in steps.items() if s["status"] != "ok"}
    assert not broken, broken
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert report["failed"] == []
    assert set(steps) == {
        "versions",
        "gpu_tests",
        "bench_train",
        "bench_train_grad_ckpt",
        "decode",
        "grpo",
        "engine_tests_cuda",
        "conformance_cuda",
        "grammar",
        "masters",
    }
    assert (tmp_path / "proof.log").stat().st_size > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["figures.json", "proof.log"]

    import torch

    assert steps["versions"]["figures"]["torch"] == torch.__version__

    train = steps["bench_train"]["figures"]
    assert [m["mode"] for m in train["modes"]] == ["full", "LoRA r32"]
    for mode in train["modes"]:
        assert mode["tokens_per_s"] > 0 and 0 < mode["mfu"] < 1
    merge = train["merge"]
    assert merge["merged_over_serial"] > 0 and merge["merged_items"] <= merge["calls"]
    assert steps["bench_train_grad_ckpt"]["figures"]["grad_ckpt"] is True
    # every pytest step's counts were read from its own JUnit file (collected only, on CPU)
    for name in ("gpu_tests", "engine_tests_cuda", "conformance_cuda"):
        assert steps[name]["tests"] >= 0 and steps[name]["failed_tests"] == [], name

    masters = steps["masters"]["figures"]  # 12 bytes of state a weight against 4
    assert masters["masters_state_gib"] == pytest.approx(3 * masters["plain_state_gib"])
    assert masters["plain_ms"] > 0 and masters["ratio"] > 0 and masters["widen_ms"] > 0

    grpo = steps["grpo"]["figures"]
    assert [s["version"] for s in grpo["steps"]] == [1, 2]
    assert grpo["gap_max"] <= 1e-4  # float32: the sampler's logprobs are the trainer's
    assert all(math.isfinite(s["ratio_mean"]) for s in grpo["steps"])

    decode = steps["decode"]["figures"]
    assert decode["rows"], decode
    assert {(r["arm"], r["batch"]) for r in decode["rows"]} == {
        (arm, batch) for arm in ("device", "baseline") for batch in (1, 8)
    }
    for row in decode["rows"]:
        assert row["tokens_per_s"] > 0
        if row["arm"] == "device":  # the loop copies to the host once per decode step
            assert row["transfers_per_step"] <= 1, row

    grammar = steps["grammar"]["figures"]
    assert {(r["arm"], r["batch"]) for r in grammar["rows"]} == {
        (arm, batch) for arm in ("plain", "grammar") for batch in (1, 8)
    }
    for row in grammar["rows"]:  # a constrained job too: one copy to the host per step
        assert row["tokens_per_s"] > 0 and row["transfers_per_step"] <= 1, row

    # the figures print as BENCHMARKS.md rows (scripts/gpu_report.py), the GPU named
    table = subprocess.run(
        [sys.executable, "scripts/gpu_report.py", str(tmp_path / "figures.json")],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert table.startswith("GPU proof on CPU (rehearsal)")
    assert "| LoRA r32 |" in table and "| 1 |" in table and "failed" not in table
    assert "| full bf16, 1 layers |" in table
    assert "| grammar | 8 |" in table
