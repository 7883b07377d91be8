"""Start the ranks of a distributed test as plain processes (no torchrun agent, so a rank
that dies does not take the others down with it: the tests watch how the survivors react)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from trainer.spawn import free_port

__all__ = ["free_port", "leave", "run_ranks", "two_rank_case"]


def leave(code: int) -> NoReturn:
    """End a rank process without interpreter teardown. gloo's C++ threads can abort a process
    ("terminate called without an active exception", exit -6) when its process group is
    destroyed, or torn down at exit, while the other rank is already gone (seen under load in
    CI). By now the rank's work is done and its results are written, so its exit code reports
    the work, not how teardown raced. `trainer serve` skips teardown the same way."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


ROOT = Path(__file__).resolve().parents[2]


@dataclass
class RankResult:
    rank: int
    returncode: int | None  # None: killed at the deadline
    log: str


def run_ranks(
    args: list[str],
    *,
    world_size: int,
    log_dir: Path,
    timeout_s: float,
    env: dict[str, str] | None = None,
    module: str = "tests.distributed.spmd_case",
) -> list[RankResult]:
    """Run `python -m MODULE ARGS` (default `tests.distributed.spmd_case`) as `world_size`
    ranks; wait for all (killing what is left at `timeout_s`)."""
    port = free_port()
    procs = []
    for rank in range(world_size):
        rank_env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": str(ROOT),
            **(env or {}),
        }
        log = open(log_dir / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
        cmd = [sys.executable, "-m", module, *args]
        procs.append((subprocess.Popen(cmd, cwd=ROOT, env=rank_env, stdout=log, stderr=log), log))
    deadline = time.monotonic() + timeout_s
    results = []
    for rank, (proc, log) in enumerate(procs):
        try:
            code: int | None = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            code = None
        log.close()
        results.append(RankResult(rank, code, (log_dir / f"rank{rank}.log").read_text()))
    return results


def two_rank_case(case: str, model_dir: Path, storage: Path, work: Path, *extra: str) -> Any:
    """`spmd_case CASE` on two gloo ranks over `storage` (300 s, 60 s collectives): the JSON
    rank 0 wrote; an AssertionError with a failed rank's log otherwise."""
    out = work / "two.json"
    args = [case, "--model-dir", str(model_dir), "--storage", str(storage), "--out", str(out)]
    ranks = run_ranks(
        [*args, *extra],
        world_size=2,
        log_dir=work,
        timeout_s=300.0,
        env={"TRAINER_DIST_TIMEOUT_S": "60"},
    )
    for rank in ranks:
        assert rank.returncode == 0, f"rank {rank.rank} exited {rank.returncode}:\n{rank.log}"
    return json.loads(out.read_text())
