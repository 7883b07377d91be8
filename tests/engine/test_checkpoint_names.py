"""Full model directories saved by transformers, whose files name weights as the family's hub
checkpoints do (per-expert MoE weights, a composite's legacy prefix) rather than as the loaded
model does: a full-weight session reads them as transformers converts them (docs/semantics.md
§16), both for `resume_from_hf_checkpoint` and for the base weights each new session starts
from. The reference is transformers' own load of the same directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from tests.engine.helpers import make_resource, random_batch, weights_of
from trainer.contract.errors import OperationError
from trainer.contract.specs import AdamParams, LossConfig, SessionSpec
from trainer.tiny_families import _COMPOSITE_CLASSES, save_family

CE = LossConfig(type="cross_entropy")

# the families whose saved names differ from the live ones, and one whose names do not
FAMILIES = ["qwen3_moe", "qwen3_5_moe", "gemma3_composite", "llama"]


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("named")
    return {family: save_family(family, root / family) for family in FAMILIES}


def _class(family: str) -> Any:
    return getattr(transformers, _COMPOSITE_CLASSES.get(family, "AutoModelForCausalLM"))


def _stored_names(directory: Path) -> set[str]:
    names: set[str] = set()
    for file in directory.glob("*.safetensors"):
        names |= set(load_file(str(file)))
    return names


def _reference(family: str, directory: Path) -> dict[str, torch.Tensor]:
    model = _class(family).from_pretrained(directory, dtype=torch.float32)
    return {n: p.detach() for n, p in model.named_parameters()}


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("family", FAMILIES)
def test_each_full_session_starts_from_the_base_weights(
    family: str, bases: dict[str, Path], tmp_path: Path
) -> None:
    base = bases[family]
    live = set(_reference(family, base))
    assert (live <= _stored_names(base)) == (family == "llama")  # the case each family tests
    resource = make_resource(base, tmp_path, lora=False)
    first = resource.create_session("a", SessionSpec())
    first.forward_backward(CE, random_batch(1, n=3, weights="ones"))
    first.optim_step(AdamParams(learning_rate=0.05))
    trained = weights_of(first)
    resource.close_session("a")
    second = resource.create_session("b", SessionSpec())
    _assert_equal(weights_of(second), _reference(family, base))
    assert any(not torch.equal(trained[n], w) for n, w in weights_of(second).items())


@pytest.mark.parametrize("family", FAMILIES)
def test_resume_from_a_directory_transformers_saved(
    family: str, bases: dict[str, Path], tmp_path: Path
) -> None:
    model = _class(family).from_pretrained(bases[family], dtype=torch.float32)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.01)
    saved = tmp_path / "fine-tuned"
    model.save_pretrained(saved)
    resource = make_resource(bases[family], tmp_path / "storage", lora=False)
    session = resource.create_session("a", SessionSpec(resume_from_hf_checkpoint=str(saved)))
    _assert_equal(weights_of(session), _reference(family, saved))
    assert any(
        not torch.equal(w, b)
        for w, b in zip(
            weights_of(session).values(), _reference(family, bases[family]).values(), strict=True
        )
    )


def test_a_directory_missing_an_expert_is_refused_and_leaves_no_session(
    bases: dict[str, Path], tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    _class("qwen3_moe").from_pretrained(bases["qwen3_moe"]).save_pretrained(broken)
    (file,) = broken.glob("*.safetensors")
    tensors = load_file(str(file))
    del tensors[next(k for k in tensors if ".experts.1.up_proj." in k)]
    save_file(tensors, str(file), metadata={"format": "pt"})
    resource = make_resource(bases["qwen3_moe"], tmp_path / "storage", lora=False)
    with pytest.raises(OperationError, match=r"^resume_from_hf_checkpoint") as info:
        resource.create_session("a", SessionSpec(resume_from_hf_checkpoint=str(broken)))
    assert info.value.code == "INVALID_INPUT"
    assert resource.sessions == {}
    session = resource.create_session("b", SessionSpec())  # the resource is unharmed
    _assert_equal(weights_of(session), _reference("qwen3_moe", bases["qwen3_moe"]))


@pytest.mark.parametrize("damage", ["no weights", "no rank", "not json"])
def test_an_unreadable_directory_is_a_refusal_naming_the_field(
    damage: str, bases: dict[str, Path], tmp_path: Path
) -> None:
    directory = tmp_path / "damaged"
    directory.mkdir()
    if damage == "no weights":
        (directory / "config.json").write_text("{}")
    else:
        config = "{" if damage == "not json" else '{"lora_alpha": 16, "target_modules": []}'
        (directory / "adapter_config.json").write_text(config)
    resource = make_resource(bases["llama"], tmp_path / "storage", lora=False)
    with pytest.raises(OperationError, match=r"^resume_from_hf_checkpoint") as info:
        resource.create_session("a", SessionSpec(resume_from_hf_checkpoint=str(directory)))
    assert info.value.code == "INVALID_INPUT"
    if damage == "no rank":
        assert "'r'" in info.value.message
    assert resource.sessions == {}
