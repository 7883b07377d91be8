"""The `vllm` tests: a worker whose samples run on vLLM replicas (the CPU build, float32),
checked against the in-process loop and the trainer's own forward at the same weights.

Each test module starts its replicas once (about 10 s each on CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.vllm.venv import vllm_python
from trainer.tiny import TinySpec, save_model

# vLLM's CPU attention takes head sizes of 32 and up; no EOS: every sample runs to max_tokens
SPEC = TinySpec(vocab=128, head_dim=32, eos=None, max_positions=512, scale=4.0)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def vllm_py() -> str:
    return str(vllm_python())


@pytest.fixture(scope="session")
def vllm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_model(SPEC, tmp_path_factory.mktemp("vllm-model"))
