"""The Fireworks training cookbook's GRPO recipes, `recipes/rl_loop.py` and
`recipes/async_rl_loop.py` (its own test says what it checks), unchanged, against the worker.
`rl_loop.py`: a trainer job, a deployment hot-loaded with the policy's sampler weights before the
first rollout and after every step, rollouts sampled through the token-in completions route,
a base-model reference for the KL term (LoRA: `base_only` on the policy's job; full weights: a
second, forward-only job), the client-side GRPO loss, and the final checkpoint.

The served model here is near uniform (weights at init scale) over a vocabulary with two answer
tokens, `<answer>5</answer>` (the rows' ground truth) and `<answer>3</answer>`: a completion's
first answer token is the right one about half the time, so the recipe's groups of 4 have
non-zero reward variance and steps train. Its defaults hold otherwise (`kl_beta` 0.001,
`router_replay` on, which the recipe turns off itself for a dense model after asking the
control plane).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.api.conftest import LiveServer, serve_in_thread
from tests.fireworks.test_cookbook import LORA_RANK, finite, run_phase, series
from tests.fireworks.test_cookbook_serverless import run_async
from tests.tinker.conftest import build_served_model

pytestmark = pytest.mark.fireworks

RL_MODEL = "accounts/fireworks/models/qwen3-uniform"
ANSWERS = ("<answer>5</answer>", "<answer>3</answer>")
ROWS = 4  # one prompt group a step: up to 4 steps


@pytest.fixture(scope="module")
def rl_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("rl-model")
    return build_served_model(where, scale=1.0, seed=3, tokenizer_dir=where, extra=ANSWERS)


@pytest.fixture(scope="module")
def rl_server(rl_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    storage = tmp_path_factory.mktemp("rl-storage")
    with serve_in_thread(storage, {RL_MODEL: rl_model}) as live:
        yield live


def calls_to(report: dict[str, Any], pattern: str) -> list[str]:
    return [call for call in report["calls"] if re.search(pattern, call)]


MODES = [pytest.param(LORA_RANK, id="lora"), pytest.param(0, id="full")]


@pytest.mark.parametrize("lora_rank", MODES)
def test_rl_loop_runs_to_completion(
    cookbook_py: Path,
    cookbook: Path,
    rl_server: LiveServer,
    rl_model: Path,
    tmp_path: Path,
    lora_rank: int,
) -> None:
    report = run_phase(
        cookbook_py,
        rl_server,
        cookbook,
        rl_model,
        tmp_path / "rl",
        recipe="rl",
        phase="first",
        base_model=RL_MODEL,
        lora_rank=lora_rank,
        learning_rate=1e-3 if lora_rank else 1e-4,
        epochs=1,
        max_seq_len=96,
        rows=ROWS,
        max_completion_tokens=40,
    )
    result = report["result"]
    steps = result["steps"]
    assert 1 <= steps <= ROWS, result
    assert result["deployment_id"], result
    # the recipe's own ledger: a finite reward and KL per trained step
    trained = [m for m in report["metrics"] if "train/step" in m and m["train/step"] > 0]
    assert [m["train/step"] for m in trained] == list(range(1, steps + 1)), report["metrics"]
    assert finite(series(trained, "rollout/reward")) or finite(
        series(trained, "rollout/filtered_reward")
    ), trained
    # hot-loaded before the first rollout and after every step; every rollout sampled through
    # the completions route, on the deployment
    hotloads = calls_to(report, r"^POST \S+/hot_load/v1/models/hot_load \S+ 200")
    assert len(hotloads) == steps + 1, report["calls"][-30:]
    completions = calls_to(report, r"^POST \S+/inference/v1/completions \S+ 200")
    assert len(completions) >= 4 * steps, report["calls"][-30:]
    assert not calls_to(report, r" 5\d\d"), calls_to(report, r" 5\d\d")


@pytest.mark.parametrize("lora_rank", MODES)
def test_async_rl_loop_runs_on_a_hot_loaded_deployment(
    cookbook_py: Path,
    cookbook: Path,
    rl_server: LiveServer,
    rl_model: Path,
    tmp_path: Path,
    lora_rank: int,
) -> None:
    """`recipes/async_rl_loop.py` as written (`async_runner.py`, its defaults but the loop's
    size: `kl_beta` 0.001 with a reference, `router_replay` on): a trainer job, a deployment
    hot-loaded with each published version, token-in rollouts through the completions route,
    the client-side GRPO loss anchored on the old policy's `forward`. Each step trains on the
    version published just before it, and the rollouts' raw logprobs are the trainer's own at
    that version (`inference_k1` ~ 0), so the deployment served exactly the hot-loaded weights."""
    rows = 3
    spec = {
        "recipe": "deployment",
        "cookbook": str(cookbook),
        "base_model": RL_MODEL,
        "tokenizer": str(rl_model),
        "run_dir": str(tmp_path / "run"),
        "rows": rows,
        "group_size": 4,
        "max_completion_tokens": 8,
        "learning_rate": 1e-3 if lora_rank else 1e-4,
        "dcp_save_interval": 0,
        "lora_rank": lora_rank,
    }
    result = run_async(cookbook_py, rl_server, spec, tmp_path)
    assert result["result"]["steps"] == rows, result["result"]
    assert result["result"]["deployment_id"], result["result"]
    # the KL reference: LoRA's is the base model on the policy's own job, full weights' a job
    assert bool(result["result"]["reference_job_id"]) == (lora_rank == 0), result["result"]
    steps = [m for m in result["metrics"] if "train/step" in m and "train/grad_norm" in m]
    assert [m["train/step"] for m in steps] == list(range(1, rows + 1)), steps
    for m in steps:
        assert m["async/trained_against_version"] == m["train/step"] - 1, m
        assert m["train/raw_inference_logprob_coverage"] == 1.0, m
        assert abs(m["train/inference_k1"]) <= 1e-4 and m["train/inference_k3"] <= 1e-4, m
        assert math.isfinite(m["train/ref_kl"]) and m["train/grad_norm"] > 0, m


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def templated(model: Path, where: Path) -> Path:
    """The served model's tokenizer with a Qwen-style chat template: the distillation recipe
    renders its prompts with `apply_chat_template` (the word-level test tokenizer has none)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(where)
    return where


@pytest.mark.parametrize("lora_rank", MODES)
def test_distillation_loop_runs_to_completion(
    cookbook_py: Path,
    cookbook: Path,
    rl_server: LiveServer,
    rl_model: Path,
    tmp_path: Path,
    lora_rank: int,
) -> None:
    """`recipes/distillation_loop.py` as written (sampled reverse KL, its defaults but the
    loop's size): the student's deployment hot-loaded each step, a teacher deployment the
    recipe creates for `teacher_model` (here the base model itself), the teacher scoring the
    student's samples, the server-side `importance_sampling` loss with its `ratio_log_cap`."""
    report = run_phase(
        cookbook_py,
        rl_server,
        cookbook,
        templated(rl_model, tmp_path / "tokenizer"),
        tmp_path / "distill",
        recipe="distill",
        phase="first",
        base_model=RL_MODEL,
        teacher_model=RL_MODEL,
        lora_rank=lora_rank,
        learning_rate=1e-3 if lora_rank else 1e-4,
        epochs=1,
        max_seq_len=96,
        rows=3,
        max_completion_tokens=12,
    )
    steps = report["result"]["steps"]
    assert steps == 3, report["result"]
    trained = [m for m in report["metrics"] if "train/step" in m and "train/grad_norm" in m]
    assert [m["train/step"] for m in trained] == [1, 2, 3], report["metrics"]
    assert all(finite([m["train/loss:sum"], m["train/grad_norm"]]) for m in trained), trained
    # step 1: the student's deployment serves the step-0 weights, which are the base model's,
    # as the teacher's deployment does: the two score every sampled token alike
    assert trained[0]["train/opd_abs_logprob_gap"] <= 1e-5, trained[0]
    assert trained[-1]["train/opd_abs_logprob_gap"] > 1e-4, trained[-1]  # the student moved
    # the teacher's deployment: made by the first run on this worker, reused by the next
    teacher = calls_to(report, r"/deployments(/|\?deploymentId=)distillation-teacher-\S+ \S+ 200")
    assert teacher, report["calls"][-30:]
    hotloads = calls_to(report, r"^POST \S+/hot_load/v1/models/hot_load \S+ 200")
    assert len(hotloads) >= steps, report["calls"][-30:]
    assert not calls_to(report, r" 5\d\d"), calls_to(report, r" 5\d\d")
