"""A live worker for the official Fireworks training SDK (`tests/fireworks/venv.py`).

The catalogue serves two tiny random models under Fireworks-style names (the cookbook's
`validate_config` wants a base model that starts with `accounts/`), each with the word-level
tokenizer of the Tinker tests (`tests.tinker.conftest.build_tokenizer`) in its own directory:
- `QWEN`: a tiny Qwen3 (tied head), weights scaled 8x so logprobs are far from uniform;
- `LLAMA`: a tiny Llama (untied head), the second family.

`run_fw` runs a script with a venv's python, `FIREWORKS_BASE_URL` and `FIREWORKS_API_KEY`
pointing at the worker, and returns the JSON object it prints last.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.api.conftest import TOKEN, LiveServer, serve_in_thread
from tests.cached_venv import run_json
from tests.fireworks.cookbook_venv import cookbook_dir, cookbook_python
from tests.fireworks.venv import VERSIONS, fireworks_python
from tests.tinker.conftest import build_served_model

HERE = Path(__file__).parent
SCRIPTS = HERE / "sdk_scripts"
REPO = HERE.parent.parent

QWEN = "accounts/fireworks/models/qwen3-tiny"
LLAMA = "accounts/fireworks/models/llama-tiny"


@pytest.fixture(scope="session", params=VERSIONS)
def fw_python(request: pytest.FixtureRequest) -> Path:
    """Each SDK line in turn (tests that take this fixture run once per version)."""
    return fireworks_python(request.param)


@pytest.fixture(scope="session")
def fw_python_latest() -> Path:
    return fireworks_python(VERSIONS[0])


@pytest.fixture(scope="session")
def fw_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fireworks-models")
    qwen, llama = root / "qwen", root / "llama"
    return {
        QWEN: build_served_model(qwen, scale=8.0, seed=0, tokenizer_dir=qwen),
        LLAMA: build_served_model(llama, scale=8.0, seed=1, tokenizer_dir=llama, arch="llama"),
    }


@pytest.fixture(scope="module")
def fw_server(
    fw_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    storage = tmp_path_factory.mktemp("fireworks-storage")
    with serve_in_thread(storage, fw_models) as live:
        yield live


@pytest.fixture(scope="session")
def cookbook() -> Path:
    where = cookbook_dir()
    if where is None:
        pytest.skip(
            "the Fireworks training cookbook is not here: set FW_COOKBOOK_DIR to a checkout of "
            "fw-ai/cookbook (the directory holding training/), or FW_COOKBOOK_MIRROR to a git "
            "mirror of it (default /work/.mirror/fw-ai+cookbook/repo)"
        )
    return where


@pytest.fixture(scope="session")
def cookbook_py(cookbook: Path) -> Path:
    return cookbook_python()


def fw_env(server: LiveServer, api_key: str = TOKEN, **extra: str) -> dict[str, str]:
    """The environment a Fireworks user sets, pointed at the worker."""
    env = dict(os.environ)
    for name in [n for n in env if n.startswith("FIREWORKS_")]:
        del env[name]
    env.update(
        FIREWORKS_BASE_URL=server.url,
        FIREWORKS_API_KEY=api_key,
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        WANDB_MODE="disabled",
        PYTHONPATH=str(REPO),
        **extra,
    )
    return env


def run_fw(
    python: Path,
    server: LiveServer,
    argv: list[str],
    timeout: float = 300,
    api_key: str = TOKEN,
    **env: str,
) -> dict[str, Any]:
    """Run `python argv...` against `server`; the JSON object on its last stdout line."""
    return run_json(python, argv, fw_env(server, api_key, **env), timeout, REPO)


def bpe_chat_model(
    where: Path,
    arch: str,
    template: str,
    seed: int,
    added: tuple[str, ...] = (),
    special: bool = False,
) -> Path:
    """A tiny `arch` model (qwen3 tied, else untied) with a byte-level BPE tokenizer, which
    constrained decoding can read, and `template` as its chat template. `added`: tokens added
    to its vocabulary as Qwen3's `<think>` and `<tool_call>` are (not special: decoding keeps
    them), or as `special` ones (decoding drops them)."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    from tests.engine.test_grammar import build_bpe_tokenizer
    from trainer.tiny import TinySpec, save_model

    build_bpe_tokenizer(where)
    tokenizer = AutoTokenizer.from_pretrained(where)
    tokenizer.add_tokens([AddedToken(t, special=special, normalized=False) for t in added])
    tokenizer.chat_template = template
    tokenizer.save_pretrained(where)
    vocab, tied = len(tokenizer), arch == "qwen3"
    spec = TinySpec(arch=arch, vocab=vocab, tied=tied, bos=None, eos=1, scale=4.0)
    return save_model(spec, where, seed=seed)


@contextlib.contextmanager
def serve_for_alice(
    models: dict[str, Path], factory: pytest.TempPathFactory, keys: dict[str, str]
) -> Iterator[LiveServer]:
    """A worker over `models` with one user, alice, whose keys go into `keys`."""
    from tests.api.team_helpers import write_keys
    from trainer.api.keys import KeyRing

    path = factory.mktemp("keys") / "keys.toml"
    keys.update(write_keys(path, (), ("alice",)))
    with serve_in_thread(factory.mktemp("storage"), models, keys=KeyRing(path)) as server:
        yield server


def client_script(args: str, body: str, imports: str = "") -> str:
    """A script for `run_inline`: `url, key, ARGS = sys.argv[1:]`, a Fireworks SDK `client`
    on that URL and key, then `body` (`imports` go after the SDK's)."""
    head = f"import json, sys\nfrom fireworks import Fireworks\n{imports}"
    return (
        head
        + f"url, key, {args} = sys.argv[1:]\nclient = Fireworks(api_key=key, base_url=url)\n"
        + body
    )


def run_inline(python: Path, script: str, argv: list[str], cwd: Path | None = None) -> Any:
    """Run a venv's `python -c script argv...` offline, with only the system PATH (no key or
    URL from this process's environment: the script takes them from `argv`); the JSON value
    on its last stdout line."""
    done = subprocess.run(
        [str(python), "-c", script, *argv],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
