"""A virtual environment for the Fireworks training cookbook (`fw-ai/cookbook`, `training/`),
built once and cached, and the cookbook's `training/` tree itself.

The venv holds the cookbook's declared requirements (`training/pyproject.toml`) at the versions it
runs on: `fireworks-ai[training]` 1.2.9 (the cookbook builds `tinker` 0.23 datums, which 1.2.30
refuses), `tinker-cookbook` 0.4.3 and `transformers` 5.5.4. It shares the test environment's
torch (`--system-site-packages`) and lives under `~/.cache/trainer-tests/` while the pins are
unchanged (`tests/cached_venv.py`).

The cookbook is not on the package index. `cookbook_dir` finds it at `$FW_COOKBOOK_DIR` (a
checkout holding `training/`), or exports `training/` from the bare mirror at
`$FW_COOKBOOK_MIRROR` (default `/work/.mirror/fw-ai+cookbook/repo`) at its `HEAD`; without
either it returns None and the tests skip. The recipes run from that tree, never from a copy in
this repository.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests import cached_venv

PINS = (
    "fireworks-ai[training]==1.2.9",
    "tinker-cookbook==0.4.3",
    "transformers==5.5.4",
    "tqdm",
    "datasets",
    "tiktoken",
    "numpy",
    "python-dotenv",
    "wandb",
    "orjson",
    "hydra-core>=1.3,<2",
)
MIRROR = Path("/work/.mirror/fw-ai+cookbook/repo")


def venv_dir() -> Path:
    return cached_venv.venv_dir("fw-cookbook", PINS)


def cookbook_python() -> Path:
    """The venv's python (built on first use)."""

    def fill(python: Path) -> None:
        pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        subprocess.run([*pip, *PINS], check=True)
        probe = (
            "import fireworks.training.sdk, tinker, tinker_cookbook, transformers, hydra\n"
            "assert transformers.__version__ == '5.5.4', transformers.__version__"
        )
        subprocess.run([str(python), "-c", probe], check=True)

    return cached_venv.cached_python(venv_dir(), fill, system_site_packages=True)


def _git(mirror: Path, *args: str) -> str:
    proc = subprocess.run(["git", "-C", str(mirror), *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} in {mirror}: {proc.stderr.strip()}")
    return proc.stdout.strip()


def cookbook_dir() -> Path | None:
    """A directory holding the cookbook's `training/` package (on `sys.path` it imports as
    `training`), or None when there is neither `$FW_COOKBOOK_DIR` nor the mirror. The export
    is cached beside the venvs, named by the mirror's commit."""
    given = os.environ.get("FW_COOKBOOK_DIR")
    if given:
        root = Path(given)
        if not (root / "training" / "recipes" / "sft_loop.py").exists():
            raise FileNotFoundError(f"FW_COOKBOOK_DIR={given} holds no training/recipes/")
        return root
    mirror = Path(os.environ.get("FW_COOKBOOK_MIRROR", MIRROR))
    if not mirror.exists() or shutil.which("git") is None:
        return None
    commit = _git(mirror, "rev-parse", "HEAD")
    cache = cached_venv.venv_dir("fw-cookbook", ()).parent  # where the venvs live
    where = cache / f"fw-cookbook-tree-{commit[:12]}"
    if (where / ".complete").exists():
        return where
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{where.name}.", dir=cache))
    try:
        tar = staging / "training.tar"
        _git(mirror, "archive", "--format=tar", "-o", str(tar), commit, "training")
        subprocess.run(["tar", "-xf", str(tar), "-C", str(staging)], check=True)
        tar.unlink()
        (staging / "COMMIT").write_text(commit + "\n")
        (staging / ".complete").touch()
        staging.rename(where)
    except OSError:  # another process renamed its export there first
        if not (where / ".complete").exists():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return where


if __name__ == "__main__":
    print(cookbook_python())
    print(cookbook_dir())
