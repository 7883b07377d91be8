"""`trainer demo --steps 5` end to end: a real worker process, the official SDK over HTTP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from trainer.rl.config import Recipe

ROOT = Path(__file__).resolve().parents[2]
REQUIRED = {"step", "reward/mean", "reward/std", "loss", "grad_norm", "tokens_per_s"}


def _demo() -> list[str]:
    """`python -m trainer demo` once the CLI has the subcommand, else `-m trainer.demo`."""
    import contextlib
    import io

    from trainer.cli import build_parser

    with contextlib.redirect_stderr(io.StringIO()):
        try:
            build_parser().parse_args(["demo", "--out", "x"])
        except SystemExit:
            return [sys.executable, "-m", "trainer.demo"]
    return [sys.executable, "-m", "trainer", "demo"]


def test_demo_five_steps(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [*_demo(), "--out", str(out), "--steps", "5"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "step    5 | reward" in proc.stdout and "done: 5 steps" in proc.stdout

    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]
    assert [m["weights_version"] for m in metrics] == [1, 2, 3, 4, 5]
    for m in metrics:
        assert m.keys() >= REQUIRED and m["version/staleness"] == 0
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    recipe = Recipe.model_validate_json((out / "config.json").read_text())
    assert recipe.loop.steps == 5 and recipe.model.source == "tiny"
    ids = json.loads((out / "checkpoints.json").read_text())
    assert ids["training_checkpoint_id"] and ids["inference_checkpoint_id"]
    assert json.loads((out / "summary.json").read_text())["steps"] == 5


def test_demo_runs_the_qwen3_lora_recipe_offline(tmp_path: Path, chat_model_dir: Path) -> None:
    """`configs/qwen3_0.6b_lora.toml` with the hub model swapped for a tiny local chat model:
    tokenizer + chat template, LoRA rank 32 with train_unembed on a tied head, off-policy."""
    text = (ROOT / "configs" / "qwen3_0.6b_lora.toml").read_text()
    replacements = {
        'location = "Qwen/Qwen3-0.6B"': f'location = "{chat_model_dir}"',
        'dtype = "bfloat16"': 'dtype = "float32"',
        "prompts_per_step = 32": "prompts_per_step = 2",
        "group_size = 8": "group_size = 2",
        "eval_prompts = 128": "eval_prompts = 2",
        "max_tokens = 16": "max_tokens = 4",
    }
    for old, new in replacements.items():
        assert old in text, old
        text = text.replace(old, new)
    config = tmp_path / "qwen3_tiny.toml"
    config.write_text(text)
    out = tmp_path / "qwen"
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    command = [*_demo(), "--out", str(out), "--steps", "2"]
    proc = subprocess.run(
        [*command, "--config", str(config), "--device", "cpu"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "task arithmetic, grpo off_policy, 2x2" in proc.stdout
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["version/staleness"] for m in metrics] == [0, 1]
    recipe = Recipe.model_validate_json((out / "config.json").read_text())
    assert recipe.resource.lora_rank == 32 and recipe.resource.train_unembed
    assert json.loads((out / "checkpoints.json").read_text())["inference_checkpoint_id"]
