"""`trainer.tiny` is the one tiny-model builder: for every call site's parameters it builds the
very model (config and weights) that a plain transformers config with the same seed builds.

The references below build each call site's model (the demo, the benchmarks, the test fixtures)
with a plain transformers config, independently of `trainer.tiny`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from benchmarks.shapes import ModelShape, build_model, qwen3_config, shape_from
from trainer.rl.config import ModelConfig
from trainer.tiny import TinySpec, save_model
from trainer.tiny import build_model as tiny_build


def _old_rl(config: ModelConfig) -> Any:
    """The demo's model, as `trainer/rl/models.py` built it."""
    common: dict[str, Any] = dict(
        vocab_size=16,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        max_position_embeddings=config.max_seq_length,
        bos_token_id=10,
        eos_token_id=12,
        pad_token_id=13,
    )
    hf_config = (
        Qwen3Config(
            head_dim=config.hidden_size // config.num_heads, tie_word_embeddings=True, **common
        )
        if config.arch == "qwen3"
        else LlamaConfig(tie_word_embeddings=False, **common)
    )
    torch.manual_seed(config.init_seed)
    return AutoModelForCausalLM.from_config(hf_config)


def _old_bench_config(shape: ModelShape, **extra: Any) -> Any:
    return Qwen3Config(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        tie_word_embeddings=shape.tied,
        **extra,
    )


def _old_bench(shape: ModelShape, seed: int, dtype: torch.dtype) -> Any:
    ids = dict(eos_token_id=1, bos_token_id=0, pad_token_id=0)
    config = _old_bench_config(shape, max_position_embeddings=32768, **ids)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _old_tests(kind: str, seed: int = 0) -> Any:
    common: dict[str, Any] = dict(
        vocab_size=128,
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
        config: Any = Qwen3Config(head_dim=16, tie_word_embeddings=True, **common)
    else:
        config = LlamaConfig(tie_word_embeddings=False, **common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.mul_(8.0)
    return model


def _old_chat(eos: int, pad: int, seed: int = 0) -> Any:
    config = Qwen3Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def _same(new: Any, old: Any) -> None:
    a, b = new.config.to_dict(), old.config.to_dict()
    assert a == b, {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
    _same_weights(new, old)


def _same_weights(new: Any, old: Any) -> None:
    assert type(new) is type(old)
    new_sd, old_sd = new.state_dict(), old.state_dict()
    assert new_sd.keys() == old_sd.keys()
    for name, tensor in old_sd.items():
        assert new_sd[name].dtype == tensor.dtype, name
        assert torch.equal(new_sd[name], tensor), name
    assert any(t.abs().sum() > 0 for t in new_sd.values())


RL_CONFIGS = [
    ModelConfig(),  # configs/demo.toml
    ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1),  # tests/rl fixture
    ModelConfig(arch="llama", hidden_size=48, num_heads=6, num_kv_heads=3, init_seed=5),
]


@pytest.mark.parametrize("config", RL_CONFIGS, ids=["demo", "rl-tests", "llama"])
def test_demo_model_is_unchanged(config: ModelConfig) -> None:
    _same(tiny_build(config.tiny_spec(), config.init_seed), _old_rl(config))


@pytest.mark.parametrize(
    "shape",
    [ModelShape(vocab=4096), ModelShape(vocab=3000, tied=False, layers=3, hidden=96, head_dim=32)],
    ids=["tied", "untied"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bench_model_is_unchanged(shape: ModelShape, dtype: torch.dtype) -> None:
    _same(build_model(shape, seed=3, dtype=dtype), _old_bench(shape, 3, dtype))


def test_bench_gpu_config_is_unchanged() -> None:
    """`scripts/bench_gpu.py` builds from `qwen3_config(shape, max_position_embeddings=...)`."""
    shape = ModelShape(vocab=1000, tied=False)
    old = _old_bench_config(shape, max_position_embeddings=40960)
    assert qwen3_config(shape, max_position_embeddings=40960).to_dict() == old.to_dict()


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_test_fixture_models_are_unchanged(kind: str) -> None:
    from tests.conftest import tiny_spec

    _same(tiny_build(tiny_spec(kind)), _old_tests(kind))


def test_chat_model_is_unchanged(tmp_path: Path) -> None:
    from tests.rl.helpers import build_chat_model

    out = build_chat_model(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(out)
    eos, pad = loaded.config.eos_token_id, loaded.config.pad_token_id
    assert (eos, pad) == (3, 1)
    assert loaded.config.bos_token_id is None
    _same_weights(loaded, _old_chat(eos, pad))


def test_saved_model_reloads_with_the_same_weights(tmp_path: Path) -> None:
    spec = TinySpec(arch="llama", tied=False, scale=8.0)
    out = save_model(spec, tmp_path / "m", seed=2)
    built = tiny_build(spec, seed=2)
    _same_weights(AutoModelForCausalLM.from_pretrained(out), built)
    other = tiny_build(spec, seed=3)
    name = "model.embed_tokens.weight"
    assert not torch.equal(other.state_dict()[name], built.state_dict()[name])


def test_bench_shape_json_is_unchanged() -> None:
    """A bench row's shape JSON (and so its model directory's name) keeps its eight fields."""
    shape = ModelShape(vocab=2048, hidden=32, intermediate=64, layers=1, heads=2, head_dim=16)
    assert shape.to_json() == {
        "vocab": 2048,
        "hidden": 32,
        "intermediate": 64,
        "layers": 1,
        "heads": 2,
        "kv_heads": 2,
        "head_dim": 16,
        "tied": True,
    }
    assert shape_from({"shape": shape.to_json()}) == shape
    assert shape.describe() == "V=2,048 H=32 L=1 I=64 heads=2/2x16 tied"
