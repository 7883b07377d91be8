"""The `[engine]` / `[distributed]` knobs reach every rank of a torchrun job.

Two gloo ranks parse `trainer serve`'s flags and join the job as the command does
(`trainer.cli.join_job`); rank 0 counts, with forward hooks on its sharded model, the
micro-batches (row tokens, token budget), the logprob-head chunks (chunk tokens) and the
recomputed layers (activation checkpointing) of one forward and one forward-backward, and reads
its process groups' timeouts and its FSDP offload policy.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.launch import ROOT, free_port

pytestmark = pytest.mark.distributed

FLAGS = [
    *("--engine-row-tokens", "9", "--engine-token-budget", "9", "--engine-chunk-tokens", "4"),
    "--engine-activation-checkpointing",
    *("--distributed-collective-timeout-s", "42"),
]


def _run(model_dir: Path, work: Path, flags: list[str]) -> dict:
    port, out, procs = free_port(), work / "out.json", []
    for rank in range(2):
        env = {
            **os.environ,
            **{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"},
            **{"RANK": str(rank), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1"},
            **{"HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)},
        }
        env.pop("TRAINER_DIST_TIMEOUT_S", None)
        cmd = [sys.executable, "-m", "tests.distributed.config_case", str(model_dir), str(work)]
        procs.append(
            subprocess.Popen(
                [*cmd, str(out), *flags],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    for rank, proc in enumerate(procs):
        log, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{log}"
    result: dict = json.loads(out.read_text())
    return result


def test_knobs_reach_every_rank(tiny_qwen_dir: Path, tmp_path: Path) -> None:
    result = _run(tiny_qwen_dir, tmp_path, FLAGS)
    # 4 samples of 9 tokens, 2 per rank: rows of 9 and a budget of 9 give one micro-batch per
    # sample (the defaults would give one for both), 4-token head chunks (else one), and
    # checkpointing runs each layer again in the backward
    batches = [9, 9]
    assert result["forward"]["layer"] == len(batches)
    assert result["forward"]["head"] == sum(math.ceil(n / 4) for n in batches)
    assert result["backward"]["layer"] == 2 * len(batches)
    assert result["checkpointing"] is True
    assert result["timeouts"] == [42.0, 84.0]  # in-op collectives, outcomes (twice)
    assert result["offload"] == "OffloadPolicy" and result["cpu_offload"] is False


def test_cpu_offload_reaches_every_rank(tiny_qwen_dir: Path, tmp_path: Path) -> None:
    """FSDP2's CPU offload needs an accelerator: on CPU the ranks only join the job with it."""
    flags = ["--distributed-cpu-offload"]
    result = _run(tiny_qwen_dir, tmp_path, flags)
    assert result["cpu_offload"] is True
    assert result["timeouts"] == [600.0, 1200.0]
