"""Shared fixtures: tiny random models built from configs, saved and loaded back for real.

Two shapes cover the cases that bite: a tied Qwen3-style model (lm_head shares the input
embedding, like Qwen3-0.6B) and an untied Llama-style one.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trainer.tiny import TinySpec, save_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

VOCAB = 128


def tiny_spec(kind: str) -> TinySpec:
    """The two test shapes; weights scaled up 8x so that logprobs are far from uniform."""
    if kind not in ("qwen3", "llama"):
        raise ValueError(kind)
    return TinySpec(arch=kind, vocab=VOCAB, tied=kind == "qwen3", scale=8.0)


def build_tiny_model(kind: str, out_dir: Path, seed: int = 0) -> Path:
    return save_model(tiny_spec(kind), out_dir, seed)


@pytest.fixture(scope="session")
def tiny_qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("qwen3", tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tied tiny Qwen3-MoE (every layer sparse: 4 experts, top-2, fused 3-D expert weights)."""
    spec = TinySpec(arch="qwen3_moe", vocab=VOCAB, tied=True, scale=8.0)
    return save_model(spec, tmp_path_factory.mktemp("tiny-qwen3-moe"))


@pytest.fixture(params=["qwen3", "llama"])
def tiny_model_dir(
    request: pytest.FixtureRequest, tiny_qwen_dir: Path, tiny_llama_dir: Path
) -> Path:
    return tiny_qwen_dir if request.param == "qwen3" else tiny_llama_dir
