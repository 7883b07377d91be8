"""The RL loop with a Muon resource (`configs/demo_muon.toml`): the recipe's optimizer reaches
the resource, each step sends `muon_params`, and the digit-copy reward rises."""

from __future__ import annotations

from pathlib import Path

from trainer.compute.muon import MuonWithAdamW
from trainer.rl.client import LocalClient
from trainer.rl.config import Recipe, load_recipe
from trainer.rl.loop import RLLoop, optim_params
from trainer.rl.tasks import make_task

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_demo_muon_recipe_is_the_demo_with_muon() -> None:
    muon = load_recipe(CONFIGS / "demo_muon.toml")
    assert muon.resource.optimizer_config() == {
        "muon": {"scaling_strategy": "MUON_SCALING_STRATEGY_MATCH_ADAM"}
    }
    plain = Recipe()
    assert muon.model_copy(update={"resource": plain.resource}) == plain
    body = optim_params(muon, 3e-3)
    assert body["muon_params"]["learning_rate"] == body["muon_params"]["adam"]["learning_rate"]
    assert "grad_clip_norm" not in body["muon_params"]["adam"]
    assert set(optim_params(plain, 3e-3)) == {"adam_params"}


def test_muon_loop_learns(digits_model_dir: Path, tmp_path: Path) -> None:
    loop = {"steps": 12, "prompts_per_step": 8, "group_size": 8, "learning_rate": 1e-2}
    recipe = Recipe.model_validate(
        {"seed": 1, "task": {"length": 3}, "resource": {"optimizer": "muon"}, "loop": loop}
    )
    client = LocalClient(
        digits_model_dir,
        tmp_path / "store",
        name="m",
        lora=False,
        device="cpu",
        optimizer_config=recipe.resource.optimizer_config(),
    )
    assert isinstance(client.session.optimizer, MuonWithAdamW)
    history = RLLoop(client, make_task(recipe.task), recipe).run()
    rewards = [m["reward/mean"] for m in history]
    assert [m["step"] for m in history] == list(range(1, 13))
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.02, rewards  # seeded: no flakes
