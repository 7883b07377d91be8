"""Virtual environments the tests build once and reuse (`tests/tinker/venv.py`,
`tests/vllm/venv.py`): under `~/.cache/trainer-tests/` (or `$TRAINER_TEST_CACHE`), named by a
digest of the Python version and what goes in, so a changed pin builds a new one."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any


def venv_dir(name: str, pins: Iterable[str]) -> Path:
    digest = hashlib.sha256("\n".join((sys.version, *pins)).encode()).hexdigest()[:12]
    root = Path(os.environ.get("TRAINER_TEST_CACHE", Path.home() / ".cache" / "trainer-tests"))
    return root / f"{name}-venv-{digest}"


def cached_python(
    where: Path, fill: Callable[[Path], None], system_site_packages: bool = False
) -> Path:
    """`where`'s python, the venv made and `fill(python)` run on first use only (a file lock
    keeps parallel builders apart; `.complete` marks a finished build)."""
    python = where / "bin" / "python"
    done = where / ".complete"
    where.parent.mkdir(parents=True, exist_ok=True)
    with open(where.parent / f"{where.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists():
            return python
        shared = ["--system-site-packages"] if system_site_packages else []
        subprocess.run([sys.executable, "-m", "venv", "--clear", *shared, str(where)], check=True)
        fill(python)
        done.touch()
    return python


def run_json(
    python: Path, argv: list[str], env: dict[str, str], timeout: float, cwd: Path
) -> dict[str, Any]:
    """Run `python argv...` (a venv's script); the JSON object on its last stdout line that
    starts with `{`. A failed run raises with the tails of its output."""
    proc = subprocess.run(
        [str(python), *argv], env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"{argv} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
            f"\n--- stderr\n{proc.stderr[-8000:]}"
        )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"{argv} printed no JSON\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    result: dict[str, Any] = json.loads(lines[-1])
    return result
