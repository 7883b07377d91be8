"""The demo's tiny model: built from a config with random weights, saved like any HF model.

It has its own 16-token vocabulary (digits are ids 0-9, see `tasks.py`), so no tokenizer and no
download are needed; the worker loads it from the directory exactly as it loads a real model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainer.rl.config import ModelConfig
from trainer.rl.tasks import BOS, DIGITS_VOCAB, EOS, PAD


def build_tiny_model(config: ModelConfig, out_dir: Path) -> Path:
    """Random-init a small Qwen3- or Llama-shaped model and `save_pretrained` it to `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config
    from transformers.utils import logging as hf_logging

    common: dict[str, Any] = dict(
        vocab_size=DIGITS_VOCAB,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        max_position_embeddings=config.max_seq_length,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    hf_config = (
        Qwen3Config(
            head_dim=config.hidden_size // config.num_heads, tie_word_embeddings=True, **common
        )
        if config.arch == "qwen3"
        else LlamaConfig(tie_word_embeddings=False, **common)
    )
    hf_logging.disable_progress_bar()
    torch.manual_seed(config.init_seed)
    model = AutoModelForCausalLM.from_config(hf_config)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    return out_dir
