"""A virtual environment with the official `tinker` SDK and tinker-cookbook, built once.

`together` 3.1.1 pins `tinker==0.23.1`, so the SDK that tinker-cookbook 0.6.1 needs
(`tinker>=0.38`) cannot live in the test environment itself. This builds a venv beside it
(`--system-site-packages`, so torch and transformers are shared, not downloaded again) under
`~/.cache/trainer-tests/`, and reuses it while the pins below are unchanged.

tinker-cookbook 0.6.1 declares `tml-renderers>=0.4.1`, which the package index does not have;
only its Inkling and Kimi renderers use it, so the cookbook goes in with `--no-deps` plus its
other declared requirements and the `math-rl` extra.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests import cached_venv

TINKER = "tinker==0.38.0"
COOKBOOK = "tinker-cookbook==0.6.1"
COOKBOOK_DEPS = (
    "aiohttp>=3.9.0",
    "anyio>=4.0.0",
    "blobfile>=3.0.0",
    "chz>=0.4.0",
    "cloudpickle>=3.0.0",
    "datasets>=2.14.0",
    "pillow>=10.0.0",
    "pyrage>=1.4.0",
    "termcolor>=2.0.0",
    "tiktoken>=0.12.0",
    "tqdm>=4.60.0",
    # the math-rl extra
    "math-verify>=0.5.0",
    "pylatexenc>=2.0",
    "sympy>=1.12.0",
)
_PINS = (TINKER, COOKBOOK, *COOKBOOK_DEPS)


def venv_dir() -> Path:
    return cached_venv.venv_dir("tinker", _PINS)


def tinker_python() -> Path:
    """The venv's python (built on first use)."""

    def fill(python: Path) -> None:
        pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        subprocess.run([*pip, TINKER], check=True)
        subprocess.run([*pip, "--no-deps", COOKBOOK], check=True)
        subprocess.run([*pip, *COOKBOOK_DEPS], check=True)
        subprocess.run([str(python), "-c", "import tinker, tinker_cookbook"], check=True)

    return cached_venv.cached_python(venv_dir(), fill, system_site_packages=True)
