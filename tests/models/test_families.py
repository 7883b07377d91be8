"""Every tiny model family of `trainer.tiny_families` builds, saves as a hub checkpoint and
loads back with its own architecture class, with the same finite, non-degenerate logits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from trainer.tiny_families import FAMILIES, build_family, family_config, is_composite, save_family

HYBRID = {"linear_attention", "full_attention"}
SLIDING = {"sliding_attention", "full_attention"}
LAYER_TYPES = {
    "qwen3_5": HYBRID,
    "qwen3_5_moe": HYBRID,
    "qwen3_next": HYBRID,
    "qwen3_5_composite": HYBRID,
    "gemma3": SLIDING,
    "gemma3_composite": SLIDING,
    "gemma4": SLIDING,
    "gpt_oss": SLIDING,
    "olmo3": SLIDING,
}


def test_family_table() -> None:
    assert FAMILIES[:3] == ("qwen3", "llama", "qwen3_moe") and len(set(FAMILIES)) == 16
    assert [n for n in FAMILIES if is_composite(n)] == ["gemma3_composite", "qwen3_5_composite"]
    assert family_config("qwen3") is not family_config("qwen3")
    with pytest.raises(ValueError, match="unknown tiny family"):
        family_config("gpt2")
    for name in FAMILIES:
        text: Any = family_config(name).get_text_config()
        assert text.vocab_size == 128 and text.max_position_embeddings == 512
        assert set(getattr(text, "layer_types", None) or ()) >= LAYER_TYPES.get(name, set())
        if getattr(text, "sliding_window", None) is not None:
            assert text.sliding_window == 4, name


@pytest.mark.parametrize("name", FAMILIES)
def test_family_builds_saves_and_reloads(name: str, tmp_path: Path) -> None:
    model: Any = build_family(name, seed=0)
    ids = torch.randint(2, 128, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        built = model(input_ids=ids, use_cache=False).logits
    assert built.shape == (1, 16, 128) and torch.isfinite(built).all()
    assert 0.5 < float(built.std()) < 2.0  # the rescale keeps logits away from uniform

    out = save_family(name, tmp_path / name, seed=0)
    assert (out / "model.safetensors").is_file()
    (arch,) = json.loads((out / "config.json").read_text())["architectures"]
    assert arch == type(model).__name__
    assert arch.endswith("ForConditionalGeneration") == is_composite(name)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 1

    loaded = getattr(transformers, arch).from_pretrained(out)
    assert type(loaded).__name__ == arch
    with torch.no_grad():
        logits = loaded(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(logits, built, rtol=0, atol=1e-5)  # same seed, same weights
