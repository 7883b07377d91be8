"""The Fireworks training cookbook's serverless examples, unchanged, against the worker's
serverless surface (skipped where the cookbook is not at hand, as `test_cookbook.py` is): the
RL example `training/examples/serverless_rl/countdown_rl.py` (`countdown_runner.py`), the
DPO example `training/examples/serverless_dpo/ultrafeedback_dpo.py` (`dpo_runner.py`) and the
async RL recipe `training/recipes/experiment/async_rl_loop_serverless.py` (`async_runner.py`)
and the distillation example `training/examples/distillation/serverless_k3_privileged/`
(`distill_runner.py`); each test says what it checks.

The example's own Countdown rows (bundled with it), a tiny near-uniform model whose vocabulary
holds one `<answer>7</answer>` token: a completion earns the format reward (0.5) when it
samples that token, so groups of 4 have reward spread now and then and the steps that have it
train. Each step saves the LoRA weights for the sampler, samples that very checkpoint through
`/training/v1/serverless/inference/v1/completions`, and takes an importance-sampling step.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.conftest import LiveServer, serve_in_thread
from tests.fireworks.conftest import fw_env
from tests.tinker.conftest import build_served_model

pytestmark = pytest.mark.fireworks

HERE = Path(__file__).parent
RUNNER = HERE / "countdown_runner.py"
MODEL = "accounts/fireworks/models/qwen3-countdown"
STEPS = 3
GROUP = 4


def run_example(
    cookbook_py: Path, server: LiveServer, runner: Path, spec: dict[str, Any], cwd: Path
) -> tuple[dict[str, Any], str]:
    """Run one of the runners beside this file in the cookbook venv: the JSON report it prints
    last and its whole stdout; an AssertionError with its error, last calls, traceback and
    output when it fails (each runner exits 1 with `error` in its report then)."""
    proc = subprocess.run(
        [str(cookbook_py), str(runner), json.dumps(spec)],
        env=fw_env(server),
        capture_output=True,
        text=True,
        timeout=900,
        cwd=cwd,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    report: dict[str, Any] = json.loads(lines[-1]) if lines else {}
    if proc.returncode != 0 or not report or "error" in report:
        calls = "\n".join(report.get("calls", [])[-15:])
        raise AssertionError(
            f"{runner.name} failed: {report.get('error', f'exit {proc.returncode}')}\n"
            f"--- last calls\n{calls}\n--- traceback\n{report.get('traceback', '')[-4000:]}\n"
            f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
        )
    return report, proc.stdout


@pytest.fixture(scope="module")
def countdown_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("countdown-model")
    extra = ("<answer>7</answer>",)
    return build_served_model(where, scale=1.0, seed=5, tokenizer_dir=where, extra=extra)


@pytest.fixture(scope="module")
def countdown_server(
    countdown_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    storage = tmp_path_factory.mktemp("countdown-storage")
    with serve_in_thread(storage, {MODEL: countdown_model}) as live:
        yield live


def test_countdown_rl_runs_on_the_serverless_surface(
    cookbook_py: Path,
    cookbook: Path,
    countdown_server: LiveServer,
    countdown_model: Path,
    tmp_path: Path,
) -> None:
    spec = {
        "cookbook": str(cookbook),
        "base_model": MODEL,
        "tokenizer": str(countdown_model),
        "run_dir": str(tmp_path / "run"),
        "steps": STEPS,
        "prompt_groups": 2,
        "group_size": GROUP,
        "max_sample_tokens": 12,
        "max_seq_len": 512,
        "learning_rate": 1e-3,
    }
    report, _ = run_example(cookbook_py, countdown_server, RUNNER, spec, tmp_path)
    records = report["records"]
    assert [r["step"] for r in records] == list(range(STEPS)), records
    # every step sampled its own fresh checkpoint of the run, group by group
    snapshots = [r["snapshot"] for r in records]
    assert len(set(snapshots)) == STEPS, snapshots
    assert all(r["rollout/raw_samples"] == 2 * GROUP for r in records), records
    calls = report["calls"]
    sampled = [c for c in calls if "/training/v1/serverless/inference/v1/completions" in c]
    assert len(sampled) == STEPS * 2 * GROUP, calls[-20:]
    assert all(" 200" in c for c in sampled), sampled
    saves = [c for c in calls if "/training/v1/serverless/api/v1/save_weights_for_sampler" in c]
    assert len(saves) == STEPS + 1, calls[-20:]  # and the final one
    assert not [c for c in calls if re.search(r"HTTP/\S+ 5\d\d", c)], calls
    assert any(r["train/trained"] for r in records), records  # a group had reward spread
    for r in records:  # a step with reward spread trained, with a finite loss
        if r["train/trained"]:
            assert r["train/loss"] is None or math.isfinite(r["train/loss"]), r
        assert 0.0 <= r["rollout/raw_reward"] <= 1.0, r


DPO_RUNNER = HERE / "dpo_runner.py"
DPO_STEPS = 4


def preference_rows() -> list[dict[str, Any]]:
    """Eight pairs in the three-message shape the example reads: a question, an answer that
    names a number (chosen) and one that rambles (rejected). The last two are held out."""
    questions = ["what is two plus three ?", "what is the answer ?", "hello , what is 2 ?"]
    chosen = ["five", "3", "2", "4"]
    rejected = ["the cat sat on a mat", "hello world", "the mat", "a cat sat"]
    rows = []
    for i in range(8):
        user = {"role": "user", "content": questions[i % 3]}
        rows.append(
            {
                "chosen": {"messages": [user, {"role": "assistant", "content": chosen[i % 4]}]},
                "rejected": {"messages": [user, {"role": "assistant", "content": rejected[i % 4]}]},
            }
        )
    return rows


def run_dpo(
    cookbook_py: Path, server: LiveServer, spec: dict[str, Any], cwd: Path
) -> tuple[dict[str, Any], str]:
    report, stdout = run_example(cookbook_py, server, DPO_RUNNER, spec, cwd)
    assert not [c for c in report["calls"] if re.search(r"HTTP/\S+ 5\d\d", c)], report["calls"]
    return report, stdout


def test_dpo_runs_on_the_serverless_surface_and_resumes(
    cookbook_py: Path,
    cookbook: Path,
    countdown_server: LiveServer,
    countdown_model: Path,
    tmp_path: Path,
) -> None:
    """`ultrafeedback_dpo.py` as written: a step-0 sampler snapshot serves the frozen
    reference's `compute_logprobs`, `forward_backward_custom` takes the DPO loss, `save_state`
    every two steps, a held-out `forward` before and after, the final sampler checkpoint
    sampled beside the reference, listed on the session and promoted; then a new process
    resumes the printed checkpoint.

    At the first step of a run the policy is the reference (a zero-initialised LoRA; on resume,
    the weights the reference snapshot was taken of), so the DPO loss is ln 2 to float
    precision only if the sampler's logprobs of a checkpoint equal the trainer's forward."""
    dataset = tmp_path / "preferences.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row in preference_rows()))
    spec = {
        "cookbook": str(cookbook),
        "base_model": MODEL,
        "tokenizer": str(countdown_model),
        "dataset": str(dataset),
        "run_dir": str(tmp_path / "run"),
        "steps": DPO_STEPS,
        "batch_size": 2,
        "learning_rate": 2e-2,
        "dcp_save_interval": 2,
        "eval_pairs": 2,
    }
    report, stdout = run_dpo(cookbook_py, countdown_server, spec, tmp_path)
    records = report["records"]
    assert [r["step"] for r in records] == list(range(DPO_STEPS)), records
    first = records[0]
    assert first["train/dpo_loss"] == pytest.approx(math.log(2), abs=1e-4), first
    assert first["train/margin"] == pytest.approx(0.0, abs=1e-3), first
    assert all(math.isfinite(r["train/dpo_loss"]) for r in records), records
    # learning is judged on the same pairs before and after: each step's loss is its own
    # batch's, and a later batch's may exceed ln 2 (seen once in CI, 0.724 at step 3)
    delta = re.search(r"held-out preference margin after training: .*\(delta ([-+.\d]+)\)", stdout)
    assert delta and float(delta.group(1)) > 0, stdout[-2000:]
    assert "promoted model: accounts/" in stdout, stdout[-2000:]
    assert "=== generation comparison ===" in stdout, stdout[-2000:]
    resume = re.search(r"--resume-from (\S+/dpo-0004)", stdout)
    assert resume, stdout[-2000:]

    again = dict(spec, steps=1, run_dir=str(tmp_path / "resumed"), resume_from=resume.group(1))
    report, stdout = run_dpo(cookbook_py, countdown_server, again, tmp_path)
    [step] = report["records"]
    assert step["step"] == DPO_STEPS, step  # the step counter and data cursor go on
    # the reference re-anchors at the resumed weights: the loss is ln 2 again, so the resumed
    # policy is exactly the saved one
    assert step["train/dpo_loss"] == pytest.approx(math.log(2), abs=1e-4), step


ASYNC_RUNNER = HERE / "async_runner.py"
ASYNC_ROWS = 4


def run_async(
    cookbook_py: Path, server: LiveServer, spec: dict[str, Any], cwd: Path
) -> dict[str, Any]:
    return run_example(cookbook_py, server, ASYNC_RUNNER, spec, cwd)[0]


def trained_steps(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The recipe's per-step training records, in step order."""
    return [m for m in report["metrics"] if "train/step" in m and "train/grad_norm" in m]


def test_async_rl_runs_on_the_serverless_surface_and_resumes(
    cookbook_py: Path,
    cookbook: Path,
    countdown_server: LiveServer,
    countdown_model: Path,
    tmp_path: Path,
) -> None:
    """`recipes/experiment/async_rl_loop_serverless.py` as written, its defaults but the loop's
    size (`async_runner.py`): each step samples the snapshot the step before published, takes
    the client-side GRPO loss with the old policy's `forward` as anchor and the raw inference
    logprobs checked against it, an optimizer step, and a `save_state` every two steps; then a
    new process resumes from the step-2 state (`init_from_checkpoint`, `step_offset`)."""
    spec = {
        "cookbook": str(cookbook),
        "base_model": MODEL,
        "tokenizer": str(countdown_model),
        "run_dir": str(tmp_path / "run"),
        "rows": ASYNC_ROWS,
        "group_size": GROUP,
        "max_completion_tokens": 8,
        "learning_rate": 2e-2,
        "dcp_save_interval": 2,
    }
    report = run_async(cookbook_py, countdown_server, spec, tmp_path)
    result = report["result"]
    assert (result["steps"], result["accepted_groups"], result["resolved_rows"]) == (4, 4, 4)
    session, run = result["training_session"], result["training_run"].rsplit("/", 1)[-1]
    account = session.split("/")[1]
    states = [f"{account}/{run}/async-rl-state-step-{s}" for s in (2, 4)]
    assert result["periodic_training_checkpoints"] == states, result
    assert result["final_training_checkpoint"] == states[-1], result
    steps = trained_steps(report)
    assert [m["train/step"] for m in steps] == [1, 2, 3, 4], steps
    for m in steps:
        # each step trains on rollouts of the version just published (one snapshot a step),
        # whose raw logprobs are the trainer's forward at those weights
        assert m["async/trained_against_version"] == m["train/step"] - 1, m
        assert m["train/raw_inference_logprob_coverage"] == 1.0, m
        assert abs(m["train/inference_k1"]) <= 1e-4 and m["train/inference_k3"] <= 1e-4, m
        assert math.isfinite(m["train/grad_norm"]) and m["train/grad_norm"] > 0, m

    # the session on the control plane: a sampler snapshot a version, the two states
    listing = httpx.get(
        f"{countdown_server.url}/v1/{session}/checkpoints",
        headers={"Authorization": f"Bearer {countdown_server.token}"},
    )
    assert listing.status_code == 200, listing.text
    kinds = [row["checkpointType"] for row in listing.json()["checkpoints"]]
    assert kinds.count("CHECKPOINT_TYPE_INFERENCE_LORA") == 5, kinds
    assert kinds.count("CHECKPOINT_TYPE_TRAINING_LORA") == 2, kinds

    # a new process resumes from the step-2 state: steps 3 and 4 again, on the same rows
    resumed = dict(
        spec,
        run_dir=str(tmp_path / "resumed"),
        init_from_checkpoint=states[0],
        step_offset=2,
        resolved_rows_offset=2,
    )
    report = run_async(cookbook_py, countdown_server, resumed, tmp_path)
    result = report["result"]
    assert (result["steps"], result["accepted_groups"], result["resolved_rows"]) == (4, 4, 4)
    steps = trained_steps(report)
    assert [m["train/step"] for m in steps] == [3, 4], steps
    assert all(abs(m["train/inference_k1"]) <= 1e-4 for m in steps), steps


DISTILL_RUNNER = HERE / "distill_runner.py"


def test_privileged_distillation_runs_on_the_serverless_surface(
    cookbook_py: Path,
    cookbook: Path,
    countdown_server: LiveServer,
    countdown_model: Path,
    tmp_path: Path,
) -> None:
    """`train_serverless_k3_privileged.py` as written (`distill_runner.py`): a step-0 sampler
    snapshot as the frozen teacher, scored with `compute_logprobs` under the privileged
    prompt; each step a fresh student snapshot sampled, the reverse-KL advantages of the
    cookbook's `build_opd_server_datums`, an `importance_sampling` step. The teacher snapshot
    then samples as the session's base model does (a zero LoRA), the final student does not."""
    steps, groups = 3, 2
    spec = {
        "cookbook": str(cookbook),
        "base_model": MODEL,
        "tokenizer": str(countdown_model),
        "run_dir": str(tmp_path / "run"),
        "steps": steps,
        "prompt_groups": groups,
        "group_size": GROUP,
        "max_completion_tokens": 12,
        "learning_rate": 1e-2,
    }
    report, _ = run_example(cookbook_py, countdown_server, DISTILL_RUNNER, spec, tmp_path)
    records = report["metrics"]
    assert [r["step"] for r in records] == list(range(steps)), records
    for r in records:
        assert r["train/trained"] and r["rollout/scored_completions"] == groups * GROUP, r
        assert math.isfinite(r["train/loss"]), r
        assert math.isfinite(r["opd/opd_sampled_reverse_kl"]), r
    saved = report["checkpoints"]
    teacher = [c["path"] for c in saved["checkpoints"] if c["role"] == "teacher"]
    students = [c["path"] for c in saved["checkpoints"] if c["role"] == "student"]
    assert len(teacher) == 1 and len(students) == steps + 1, saved  # and the final one
    assert [r["student_snapshot"] for r in records] == students[:steps], (records, saved)

    session = saved["session"]
    http = httpx.Client(
        base_url=countdown_server.url,
        headers={"Authorization": f"Bearer {countdown_server.token}"},
        timeout=120,
    )

    prompt = [10, 11, 12, 13, 14, 15]

    def logprobs(model: str) -> list[float]:
        """The model's logprobs of the fixed `prompt` (echoed), so every model scores the same
        tokens."""
        body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
        r = http.post(
            "/training/v1/serverless/inference/v1/completions",
            json={**body, "logprobs": True, "echo": True},
        )
        assert r.status_code == 200, r.text
        content = r.json()["choices"][0]["logprobs"]["content"]
        return [c["logprob"] for c in content[1 : len(prompt)]]  # the first is given

    base = logprobs(session)
    assert logprobs(f"{session}/checkpoints/{teacher[0]}") == pytest.approx(base, abs=1e-5)
    final = logprobs(f"{session}/checkpoints/{students[-1]}")
    assert max(abs(a - b) for a, b in zip(final, base, strict=True)) > 1e-4, (final, base)
