"""Virtual environments with the official Fireworks training SDK, built once and cached.

Two lines of the SDK are served: `fireworks-ai` 1.2.30 (the current release; its Tinker 0.23
client core is vendored under `fireworks.training.sdk._core`) and 1.2.9 (what the Fireworks
training cookbook pins at least; it depends on the `tinker` 0.23.0 package instead). Both use the
same routes. Each venv shares the test environment's torch and transformers
(`--system-site-packages`) and lives under `~/.cache/trainer-tests/` while its pins are
unchanged (`tests/cached_venv.py`).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests import cached_venv

VERSIONS = ("1.2.30", "1.2.9")


def _pins(version: str) -> tuple[str, ...]:
    return (f"fireworks-ai[training-sdk]=={version}",)


def venv_dir(version: str) -> Path:
    return cached_venv.venv_dir(f"fireworks-{version}", _pins(version))


def fireworks_python(version: str = VERSIONS[0]) -> Path:
    """The python of the venv with `fireworks-ai` `version` (built on first use)."""

    def fill(python: Path) -> None:
        pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        subprocess.run([*pip, *_pins(version)], check=True)
        probe = "import fireworks.training.sdk as s; s.TrainerJobManager; s.FiretitanServiceClient"
        subprocess.run([str(python), "-c", probe], check=True)

    return cached_venv.cached_python(venv_dir(version), fill, system_site_packages=True)
