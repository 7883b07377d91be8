"""Virtual environments the tests build once and reuse (`tests/tinker/venv.py`,
`tests/vllm/venv.py`): under `~/.cache/trainer-tests/` (or `$TRAINER_TEST_CACHE`), named by a
digest of the Python version and what goes in, so a changed pin builds a new one."""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path


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
