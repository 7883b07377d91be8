"""Timing and peak memory of one arm, in-process or in a fresh subprocess.

Peak memory is the process's resident set high-water mark (`VmHWM`), reset through
`/proc/self/clear_refs` right before the measured steps, minus the resident set at that
moment. Unlike `ru_maxrss` it excludes whatever the set-up touched, and unlike a tensor
allocator counter (CPU torch has none; `tracemalloc` misses tensor storage) it counts every
byte the step really holds: tensors, allocator slack, and Python objects. glibc maps large
blocks (the `[C, V]` logits, the weights) with `mmap` and returns them on free, so RSS tracks
tensor memory closely. Each arm runs in its own process so that no other arm's allocations
or cached pages blur its peak.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RESULT_PREFIX = "BENCH-RESULT "


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


def rss_mb() -> float:
    return _status_kb("VmRSS") / 1024


def reset_peak() -> bool:
    """Reset the resident-set high-water mark; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return False
    return True


def peak_mb() -> float:
    return _status_kb("VmHWM") / 1024


@dataclass
class Measurement:
    """Seconds per repetition, and the peak resident memory of the measured steps."""

    times: list[float]
    peak_extra_mb: float  # high-water mark during the steps minus RSS just before them
    peak_total_mb: float  # high-water mark minus RSS of the bare interpreter + imports
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    def to_json(self) -> dict[str, Any]:
        return {
            "times": self.times,
            "peak_extra_mb": self.peak_extra_mb,
            "peak_total_mb": self.peak_total_mb,
            "extra": self.extra,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Measurement:
        return cls(
            times=list(data["times"]),
            peak_extra_mb=float(data["peak_extra_mb"]),
            peak_total_mb=float(data["peak_total_mb"]),
            extra=dict(data.get("extra", {})),
        )


_BASE_RSS: list[float] = []


def mark_base() -> None:
    """Remember the RSS before the arm builds anything (after imports)."""
    _BASE_RSS[:] = [rss_mb()]


def measure(
    step: Callable[[], Any],
    *,
    reps: int,
    warmup: int = 0,
    after: Callable[[], Any] | None = None,
) -> Measurement:
    """Run `warmup` untimed steps, then `reps` timed ones; `after` runs untimed after each."""
    for _ in range(warmup):
        step()
        if after is not None:
            after()
    base = _BASE_RSS[0] if _BASE_RSS else 0.0
    before = rss_mb()
    reset_peak()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        if after is not None:
            after()
    peak = peak_mb()
    return Measurement(times=times, peak_extra_mb=peak - before, peak_total_mb=peak - base)


def run_child(arm: str, params: dict[str, Any], *, timeout: float = 900) -> Measurement:
    """Run one arm in a fresh interpreter and read back its measurement."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "benchmarks.child", arm, json.dumps(params)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return Measurement.from_json(json.loads(line[len(RESULT_PREFIX) :]))
    tail = (proc.stdout + proc.stderr)[-3000:]
    raise RuntimeError(f"arm {arm} failed (exit {proc.returncode}):\n{tail}")
