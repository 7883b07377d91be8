"""The loop's bookkeeping: sample alignment and masks, group sizes, versions and staleness.

The engine runs in process (`LocalClient` over a real `TrainingSession` on a tiny model); the
same loop runs over HTTP in `test_demo.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.rl.client import Completion, LocalClient, parse_results, token_versions
from trainer.rl.config import Recipe
from trainer.rl.loop import Batch, RLLoop, grpo_sample, score_batch, sft_sample
from trainer.rl.tasks import DigitsTask, Problem, make_task


def _data(sample: dict, key: str) -> list:
    return sample["loss_fn_inputs"][key]["data"]


def test_grpo_sample_masks_the_prompt() -> None:
    prompt = [10, 3, 4, 11]
    completion = Completion([3, 4, 12], [-0.5, -1.0, -2.0], [0, 0, 0], "STOP_REASON_STOP")
    s = grpo_sample(prompt, completion, [0.7, 0.7, 0.7])
    assert s["model_input"]["chunks"][0]["encoded_text"]["tokens"] == [10, 3, 4, 11, 3, 4]
    assert _data(s, "target_tokens") == [3, 4, 11, 3, 4, 12]
    assert _data(s, "mask") == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    assert _data(s, "logprobs") == [0.0, 0.0, 0.0, -0.5, -1.0, -2.0]
    assert _data(s, "advantages") == [0.0, 0.0, 0.0, 0.7, 0.7, 0.7]
    assert s["loss_fn_inputs"]["target_tokens"]["dtype"] == "int64"
    with pytest.raises(ValueError):
        grpo_sample(prompt, completion, [1.0])


def test_sft_sample_weights_only_the_answer() -> None:
    s = sft_sample([10, 5, 11], [5, 12])
    assert s["model_input"]["chunks"][0]["encoded_text"]["tokens"] == [10, 5, 11, 5]
    assert _data(s, "target_tokens") == [5, 11, 5, 12]
    assert _data(s, "weights") == [0.0, 0.0, 1.0, 1.0]


def test_policy_segments_to_token_versions() -> None:
    assert token_versions([{"start_token": 0, "version": 4}], 3) == [4, 4, 4]
    segments = [{"start_token": "2", "version": "6"}, {"start_token": 0, "version": 5}]
    assert token_versions(segments, 4) == [5, 5, 6, 6]
    (group,) = parse_results(
        [
            {
                "sequences": [{"tokens": ["1", 2], "logprobs": [-1.0, -2.0], "stop_reason": "x"}],
                "policy_segments": segments,
            }
        ]
    )
    assert group[0].tokens == [1, 2] and group[0].version == 5


def _completion(tokens: list[int], version: int = 0) -> Completion:
    return Completion(tokens, [-1.0] * len(tokens), [version] * len(tokens), "STOP_REASON_LENGTH")


def test_score_batch_groups_and_skips() -> None:
    task = DigitsTask(length=2)
    problems = [Problem([10, 1, 2, 11], [1, 2], "", ""), Problem([10, 3, 4, 11], [3, 4], "", "")]
    groups = [
        [_completion([1, 2]), _completion([1, 9]), _completion([0, 0])],  # rewards 1, .5, 0
        [_completion([0, 0], 3), _completion([0, 0], 3), _completion([5, 5], 3)],  # all 0: skip
    ]
    recipe = Recipe.model_validate({"loop": {"per_token_advantages": False}})
    scored = score_batch(Batch(problems, groups), task, recipe)
    assert scored.rewards_P_G == [[1.0, 0.5, 0.0], [0.0, 0.0, 0.0]]
    assert scored.skipped_groups == 1 and len(scored.samples) == 3
    assert [_data(s, "advantages")[-1] for s in scored.samples] == pytest.approx(
        [1.2247, 0.0, -1.2247], abs=1e-3
    )
    per_token = score_batch(Batch(problems, groups), task, Recipe())
    first = [_data(s, "advantages")[-2:] for s in per_token.samples]
    assert first[1][0] == pytest.approx(first[0][0]) and first[1][1] < 0 < first[0][1]


def _recipe(**loop: object) -> Recipe:
    base = {"steps": 3, "prompts_per_step": 4, "group_size": 4, "learning_rate": 1e-2}
    return Recipe.model_validate({"seed": 1, "task": {"length": 3}, "loop": {**base, **loop}})


def _client(model_dir: Path, tmp_path: Path, lora: bool = False) -> LocalClient:
    lora_config = {"rank": 4, "alpha": 8, "seed": 0, "train_unembed": True}
    return LocalClient(
        model_dir, tmp_path / "store", name="m", lora=lora, lora_config=lora_config, device="cpu"
    )


def test_on_policy_versions(digits_model_dir: Path, tmp_path: Path) -> None:
    recipe = _recipe()
    client = _client(digits_model_dir, tmp_path)
    history = RLLoop(client, make_task(recipe.task), recipe).run()
    assert [m["step"] for m in history] == [1, 2, 3]
    assert [m["weights_version"] for m in history] == [1, 2, 3]
    assert [m["version/sampled_min"] for m in history] == [0, 1, 2]
    assert [m["version/staleness"] for m in history] == [0, 0, 0]
    for m in history:
        assert m["samples"] == (4 - m["groups/skipped"]) * 4
        assert m["kl"] == pytest.approx(0.0, abs=1e-5)  # sampler and trainer agree
        assert m["tokens_per_s"] > 0 and m["grad_norm"] >= 0
        assert 0.0 <= m["reward/mean"] <= 1.0
    assert client.session.policy_state()["pending_publish"] is False
    client.close()


def test_off_policy_versions(digits_model_dir: Path, tmp_path: Path) -> None:
    recipe = _recipe(mode="off_policy", steps=4)
    client = _client(digits_model_dir, tmp_path)
    history = RLLoop(client, make_task(recipe.task), recipe).run()
    assert [m["weights_version"] for m in history] == [1, 2, 3, 4]
    # batch k+1 is queued before batch k trains: one version behind from the second step on
    assert [m["version/sampled_min"] for m in history] == [0, 0, 1, 2]
    assert [m["version/staleness"] for m in history] == [0, 1, 1, 1]
    assert history[-1]["kl"] > 0  # stale samples: sampler and trainer now differ
    state = client.session.policy_state()
    assert state["target_weights_version"] == 4 and state["pending_publish"] is True
    assert state["applied_weights_version"] == 2  # what the last batch was sampled with
    client.close()


def test_sft_runs_through_the_same_loop(digits_model_dir: Path, tmp_path: Path) -> None:
    recipe = _recipe(objective="sft", steps=12, prompts_per_step=16, learning_rate=1e-2)
    client = _client(digits_model_dir, tmp_path)
    history = RLLoop(client, make_task(recipe.task), recipe).run()
    assert all(m["samples"] == 16 for m in history)  # one reference answer per prompt
    first, last = history[0]["loss"], history[-1]["loss"]
    assert first == pytest.approx(16 * 3 * 2.77, rel=0.35)  # sum of -log p, ~ln(16) per token
    assert last < 0.8 * first
    client.close()


def test_arithmetic_lora_recipe_path(chat_model_dir: Path, tmp_path: Path) -> None:
    """The Qwen3 recipes' path on CPU: tokenizer + chat template, LoRA with train_unembed on a
    tied head, sequence-level advantages (no per-token scores)."""
    from transformers import AutoTokenizer

    recipe = Recipe.model_validate(
        {
            "model": {"source": "pretrained", "name": "chat", "location": str(chat_model_dir)},
            "resource": {"lora": True, "lora_rank": 4},
            "task": {"name": "arithmetic", "max_operand": 9},
            "loop": {"steps": 2, "prompts_per_step": 3, "group_size": 4},
            "sampling": {"max_tokens": 6},
        }
    )
    task = make_task(recipe.task, AutoTokenizer.from_pretrained(chat_model_dir), 6)
    client = _client(chat_model_dir, tmp_path, lora=True)
    assert any("lm_head" in name for name in client.session.policy.trainable)
    loop = RLLoop(client, task, recipe)
    history = loop.run()
    assert [m["weights_version"] for m in history] == [1, 2]
    assert all(m["completion/length"] <= 6 for m in history)
    assert 0.0 <= loop.evaluate(4) <= 1.0
    training_id, inference_id = client.checkpoints()
    assert training_id != inference_id
    client.close()
