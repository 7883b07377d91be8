"""Locations: a local dir, a hub id and `hf://org/name`, resolved offline from the HF cache."""

from __future__ import annotations

import shutil

import pytest
import torch

from trainer.compute import model as model_module
from trainer.compute.model import hub_id, load_base_model, local_dir, resolve_dtype
from trainer.contract.specs import ModelEntry


def _fake_hub_cache(cache, repo: str, source) -> None:
    """Lay out a model the way huggingface_hub caches a download."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    shutil.copytree(source, root / "snapshots" / commit)


@pytest.mark.parametrize("location", ["tiny-org/tiny-qwen", "hf://tiny-org/tiny-qwen"])
def test_hub_locations_load_offline_from_cache(tiny_qwen_dir, tmp_path, monkeypatch, location):
    cache = tmp_path / "hub"
    _fake_hub_cache(cache, "tiny-org/tiny-qwen", tiny_qwen_dir)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert hub_id(location) == "tiny-org/tiny-qwen"
    resolved = local_dir(location)
    assert resolved.is_dir() and (resolved / "config.json").exists()
    model, tokenizer = load_base_model(
        ModelEntry(name="tiny", location=location), torch.device("cpu")
    )
    assert tokenizer is None
    assert model.dtype == torch.float32
    assert not any(p.requires_grad for p in model.parameters())


def test_missing_local_dir_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="no such directory"):
        local_dir(str(tmp_path / "absent"))


def test_dtype_rules() -> None:
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        (torch.bfloat16, "flash_attention_2"),
        (torch.float16, "flash_attention_2"),
        (torch.float32, "sdpa"),
    ],
)
def test_flash_attention_only_for_16_bit_weights(tiny_qwen_dir, monkeypatch, dtype, expected):
    """FlashAttention-2 computes in bf16/fp16 only: an fp32 entry on CUDA keeps SDPA."""
    monkeypatch.setattr(model_module, "_has_flash_attn", lambda: True)
    entry = ModelEntry(name="tiny", location=str(tiny_qwen_dir))
    cuda = torch.device("cuda")
    assert model_module.default_attention(str(tiny_qwen_dir), cuda, entry, dtype) == expected
    cpu = torch.device("cpu")
    assert model_module.default_attention(str(tiny_qwen_dir), cpu, entry, dtype) == "sdpa"


def test_remote_code_is_off_unless_the_entry_asks(tiny_qwen_dir, monkeypatch) -> None:
    seen = {}
    import transformers

    real = transformers.AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        seen["trust_remote_code"] = kwargs.get("trust_remote_code")
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    load_base_model(ModelEntry(name="t", location=str(tiny_qwen_dir)), torch.device("cpu"))
    assert seen["trust_remote_code"] is False
