"""Shared fixtures: tiny random models built from configs, saved and loaded back for real.

Two shapes cover the cases that bite: a tied Qwen3-style model (lm_head shares the input
embedding, like Qwen3-0.6B) and an untied Llama-style one.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

VOCAB = 128


def build_tiny_model(kind: str, out_dir: Path, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=1,
        bos_token_id=0,
        pad_token_id=0,
    )
    if kind == "qwen3":
        config = Qwen3Config(head_dim=16, tie_word_embeddings=True, **common)
    elif kind == "llama":
        config = LlamaConfig(tie_word_embeddings=False, **common)
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    # Random init leaves tiny weights; scale up so logprobs are far from uniform.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.mul_(8.0)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("qwen3", tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(params=["qwen3", "llama"])
def tiny_model_dir(
    request: pytest.FixtureRequest, tiny_qwen_dir: Path, tiny_llama_dir: Path
) -> Path:
    return tiny_qwen_dir if request.param == "qwen3" else tiny_llama_dir
