"""Fixtures for the RL tests: the demo's tiny digits model and a tiny chat model, built offline."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from trainer.rl.config import ModelConfig
from trainer.tiny import save_model

from .helpers import build_chat_model


@pytest.fixture(scope="session")
def digits_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1)
    return save_model(config.tiny_spec(), tmp_path_factory.mktemp("digits-model"), config.init_seed)


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_chat_model(tmp_path_factory.mktemp("chat-model"))
