"""Every file in `configs/` validates; the demo recipe is the built-in default."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.rl.config import Recipe, load_recipe

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
RECIPES = sorted(p for p in CONFIGS.glob("*.toml") if not p.name.startswith("serve"))


def test_the_expected_recipes_exist() -> None:
    names = {p.name for p in RECIPES}
    assert {"demo.toml", "sft_demo.toml", "qwen3_0.6b_lora.toml", "qwen3_0.6b_full.toml"} <= names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_validates(path: Path) -> None:
    recipe = load_recipe(path, {"loop.steps": 7})
    assert recipe.loop.steps == 7


def test_demo_recipe_is_the_default() -> None:
    assert load_recipe(CONFIGS / "demo.toml") == Recipe()


def test_qwen3_recipes() -> None:
    lora = load_recipe(CONFIGS / "qwen3_0.6b_lora.toml")
    full = load_recipe(CONFIGS / "qwen3_0.6b_full.toml")
    for recipe in (lora, full):
        assert recipe.model.location == "Qwen/Qwen3-0.6B" and recipe.model.dtype == "bfloat16"
        assert recipe.task.name == "arithmetic"
    assert lora.resource.lora and lora.resource.lora_rank == 32 and lora.resource.train_unembed
    assert not full.resource.lora


def test_bad_recipes_name_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[loop]\ngroup_sise = 4\n")
    with pytest.raises(ValueError, match="group_sise"):
        load_recipe(bad)
    with pytest.raises(ValueError, match=r"model\.location"):
        Recipe.model_validate({"model": {"source": "pretrained"}})


def test_serve_example_is_a_valid_catalogue() -> None:
    from trainer.serving.config import ServeConfig, load_toml

    config = ServeConfig.model_validate(load_toml(CONFIGS / "serve.example.toml"))
    assert [m.name for m in config.models] == ["qwen3-0.6b", "tiny-digits"]
    assert config.models[0].dtype == "bfloat16" and config.models[0].max_lora_rank == 128
