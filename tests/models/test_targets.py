"""LoRA targets mean what they say (docs/semantics.md §20): a conv kernel is not an expert
stack, so dense hybrids take LoRA dropout and share passes; a composite's adapter touches its
language model only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.engine.helpers import make_resource, random_batch
from tests.models.conformance import save
from trainer.compute.lora_targets import lora_target_modules, lora_target_parameters, num_experts
from trainer.contract.specs import LoraConfig, LossConfig, SessionSpec

CE = LossConfig(type="cross_entropy")


@pytest.mark.parametrize(
    ("family", "experts"),
    [
        ("qwen3_5", []),  # its linear-attention conv1d kernel is 3-D, and not an expert stack
        ("qwen3_5_moe", ["experts.down_proj", "experts.gate_up_proj"]),
        ("gpt_oss", ["experts.down_proj", "experts.gate_up_proj"]),
    ],
)
def test_expert_parameters_are_real_expert_stacks(
    family: str, experts: list[str], tmp_path: Path
) -> None:
    resource = make_resource(save(family, tmp_path / family), tmp_path / "store")
    assert lora_target_parameters(resource.model) == experts


def test_a_dense_hybrid_trains_with_dropout_and_shares_passes(tmp_path: Path) -> None:
    resource = make_resource(save("qwen3_5", tmp_path / "m"), tmp_path / "store")
    config = LoraConfig(rank=4, alpha=8, dropout=0.1, seed=1)
    session = resource.create_session("a", SessionSpec(lora_config=config))
    assert session.policy.segmentable  # LoRA on modules only: it may share passes
    out = session.forward_backward(CE, random_batch(3, n=3, weights="ones"))
    assert out["loss"] > 0


@pytest.mark.parametrize("family", ["gemma3_composite", "qwen3_5_composite"])
def test_a_composite_adapter_targets_the_language_model_only(family: str, tmp_path: Path) -> None:
    resource = make_resource(save(family, tmp_path / "m"), tmp_path / "store")
    targets = lora_target_modules(resource.model, train_unembed=True)
    assert isinstance(targets, str) and targets.startswith("^")
    session = resource.create_session(
        "a", SessionSpec(lora_config=LoraConfig(rank=4, seed=2, train_unembed=True))
    )
    record = session.save_inference_checkpoint()
    adapter = load_file(str(record.path / "adapter" / "adapter_model.safetensors"))
    assert adapter and all(
        ".language_model." in key or key.startswith("base_model.model.lm_head.") for key in adapter
    ), sorted(adapter)[:5]
    assert any("lm_head" in key for key in adapter)
    config = json.loads((record.path / "adapter" / "adapter_config.json").read_text())
    assert config["target_modules"] == targets
    towers = [n for n, _ in resource.model.named_modules() if "vision" in n or "visual" in n]
    assert towers  # it has a vision tower, and the adapter has no key in it


def test_a_later_session_on_a_plain_model_keeps_plain_targets(tmp_path: Path) -> None:
    """The first session's LoRA wrappers on the head are not a tower: the next session's
    targets are still the leaf names (a list), not a composite's regex."""
    resource = make_resource(save("qwen3", tmp_path / "m"), tmp_path / "store")
    for name in ("a", "b"):
        config = LoraConfig(rank=4, seed=3, train_unembed=True)
        session = resource.create_session(name, SessionSpec(lora_config=config))
        record = session.save_inference_checkpoint()
        saved = json.loads((record.path / "adapter" / "adapter_config.json").read_text())
        assert isinstance(saved["target_modules"], list) and "lm_head" in saved["target_modules"]


@pytest.mark.parametrize("family", ["jamba", "granitemoehybrid", "nemotron_h"])
def test_a_mamba_mixer_is_adapted_at_its_input_only(family: str, tmp_path: Path) -> None:
    """A state-space mixer's other linear layers are read directly by its scan (Jamba's
    `dt_proj`) or the fused kernels (`x_proj`, `dt_proj`, `out_proj`): not LoRA targets, so no
    adapter is silently skipped. Its `in_proj` and the attention layers are."""
    resource = make_resource(save(family, tmp_path / family), tmp_path / "store")
    targets = lora_target_modules(resource.model, train_unembed=False)
    assert isinstance(targets, list)
    leaves = {target.rsplit(".", 1)[-1] for target in targets}  # paths beside experts
    assert "in_proj" in leaves and not {"out_proj", "x_proj", "dt_proj"} & leaves, targets
    assert {"q_proj", "k_proj", "v_proj", "o_proj"} <= leaves, targets
    session = resource.create_session("a", SessionSpec(lora_config=LoraConfig(rank=4, seed=2)))
    out = session.forward_backward(CE, random_batch(3, n=3, weights="ones"))
    assert out["loss"] > 0


def test_a_name_adapted_in_one_module_and_read_directly_in_another_takes_paths() -> None:
    """Where a mixer's `out_proj` is read directly but an attention layer's `out_proj` is
    called, the targets are the modules' own paths: the attention's is adapted, the mixer's
    is not."""
    import torch
    from torch import nn

    class Mixer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.A_log, self.D = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.ones(2))
            self.in_proj, self.out_proj = nn.Linear(4, 4), nn.Linear(4, 4)

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv, self.out_proj = nn.Linear(4, 12), nn.Linear(4, 4)

    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Mixer(), Attention()])

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model, self.lm_head = Decoder(), nn.Linear(4, 8)

        def get_decoder(self) -> nn.Module:
            return self.model

        def get_output_embeddings(self) -> nn.Module:
            return self.lm_head

    model = Model()
    targets = lora_target_modules(model, train_unembed=True)
    assert isinstance(targets, list)
    names = [name for name, _ in model.named_modules() if name]
    # peft's rule for a list: a module's name is a target or ends with "." and one
    matched = {n for n in names if any(n == t or n.endswith(f".{t}") for t in targets)}
    assert matched == {
        "model.layers.0.in_proj",
        "model.layers.1.qkv",
        "model.layers.1.out_proj",
        "lm_head",
    }


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_next"])
def test_dense_layers_beside_experts_keep_the_asked_rank(family: str, tmp_path: Path) -> None:
    """A dense `gate_proj` / `up_proj` beside fused experts (DeepSeek-V3's first layer and
    shared experts, Qwen3-Next's shared expert): the adapter has the asked rank everywhere, a
    second adapter on the shared model too, and its config lists what it trains, so plain peft
    reads it back (peft ≥ 0.22 would otherwise take those names for v4 experts: a
    rank-doubled `gate_up_proj`, and the dense layers left out of the config)."""
    resource = make_resource(save(family, tmp_path / family), tmp_path / "store")
    config = LoraConfig(rank=4, seed=2)
    for name in ("a", "b"):  # the second joins a model that already holds an adapter
        session = resource.create_session(name, SessionSpec(lora_config=config))
        session.forward_backward(CE, random_batch(3, n=3, weights="ones"))
        record = session.save_inference_checkpoint()
        adapter = load_file(str(record.path / "adapter" / "adapter_model.safetensors"))
        saved = json.loads((record.path / "adapter" / "adapter_config.json").read_text())
        assert saved["r"] == 4 and not saved.get("rank_pattern"), saved
        targeted = saved["target_modules"]
        experts = num_experts(resource.model)
        for key, tensor in adapter.items():
            module = key.removeprefix("base_model.model.").split(".lora_")[0]
            if ".lora_A" not in key:
                continue
            if ".experts." in key:  # an expert stack's factor: rank 4 for each expert
                assert experts and tensor.shape[0] == 4 * experts, (key, tuple(tensor.shape))
            else:
                assert tensor.shape[0] == 4, (key, tuple(tensor.shape))
                assert module in targeted, module
