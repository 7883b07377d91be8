"""The Fireworks training cookbook's `sft_loop` and `dpo_loop` (fw-ai/cookbook, `training/`),
unchanged, against the worker: LoRA and full-parameter, each run to completion and then resumed
from its own checkpoints the cookbook's way (`training/tests/e2e/test_*_resume_e2e.py`: the same
`log_path`, `TrainerConfig(job_id=...)` naming the first run's trainer job).

The cookbook is not on the package index: it is found at `$FW_COOKBOOK_DIR` or exported from the
bare mirror (`cookbook_venv.cookbook_dir`), else these tests skip. The recipes run from that tree
in the cookbook venv (`fireworks-ai[training]` 1.2.9, `tinker-cookbook` 0.4.3, `transformers`
5.5.4); `cookbook_runner.py` only writes local data, builds each recipe's `Config` and calls its
`main`.

Each phase runs 2 optimizer steps (8 rows, batches of 4) with a checkpoint after every step; the
resumed phase runs 2 more. Every batch holds the same rows, so each step's loss, measured before
its update, is below the one before, across the resume as well: a resumed run whose weights did
not come back would start again from the first run's first loss.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.conftest import LiveServer
from tests.fireworks.conftest import QWEN, fw_env

pytestmark = pytest.mark.fireworks

HERE = Path(__file__).parent
RUNNER = HERE / "cookbook_runner.py"
PHASE_TIMEOUT_S = 900  # each DCP save waits ~15 s for the control plane to settle
MAX_SEQ_LEN = 64
RESUMABLE = ("TRAINING", "TRAINING_LORA")  # training/utils/checkpoints.py
LORA_RANK = 4
MODES = [pytest.param(LORA_RANK, id="lora"), pytest.param(0, id="full")]


def run_phase(
    python: Path,
    server: LiveServer,
    cookbook: Path,
    tokenizer: Path,
    workdir: Path,
    **spec: Any,
) -> dict[str, Any]:
    """One phase of a recipe (`cookbook_runner.py`): its JSON report, or an AssertionError
    naming the call it failed on, the error and the last requests it made."""
    full = {
        "cookbook": str(cookbook),
        "tokenizer": str(tokenizer),
        "base_model": QWEN,
        "workdir": str(workdir),
        "max_seq_len": MAX_SEQ_LEN,
        **spec,
    }
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.run(
            [str(python), str(RUNNER), json.dumps(full)],
            env=fw_env(server),
            capture_output=True,
            text=True,
            timeout=PHASE_TIMEOUT_S,
            cwd=workdir,  # the recipes load a `.env` from the working directory
        )
    except subprocess.TimeoutExpired as exc:
        stderr = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr or ""
        raise AssertionError(
            f"{spec['recipe']} ({spec['phase']}, lora_rank={spec['lora_rank']}) still ran "
            f"after {PHASE_TIMEOUT_S} s\n--- stderr\n{stderr[-6000:]}"
        ) from None
    reports = [line for line in proc.stdout.splitlines() if line.startswith('{"recipe"')]
    if proc.returncode != 0 or not reports:
        report = json.loads(reports[-1]) if reports else {}
        calls = "\n".join(report.get("calls", [])[-15:])
        raise AssertionError(
            f"{spec['recipe']} ({spec['phase']}, lora_rank={spec['lora_rank']}) failed: "
            f"{report.get('error', f'exit {proc.returncode}')}\n"
            f"--- last REST calls\n{calls}\n"
            f"--- traceback\n{report.get('traceback', '')[-4000:]}\n"
            f"--- stderr\n{proc.stderr[-6000:]}"
        )
    result: dict[str, Any] = json.loads(reports[-1])
    return result


def finite(values: list[Any]) -> bool:
    return bool(values) and all(isinstance(v, int | float) and math.isfinite(v) for v in values)


def series(metrics: list[dict[str, Any]], key: str) -> list[Any]:
    return [m[key] for m in metrics if key in m]


def decreasing(values: list[float]) -> bool:
    return all(b < a for a, b in itertools.pairwise(values))


def resumable_names(rows: list[dict[str, Any]] | str) -> set[str]:
    """The short names of the control plane's resumable rows."""
    assert isinstance(rows, list), f"list_checkpoints failed: {rows}"
    return {
        r["name"].rsplit("/", 1)[-1]
        for r in rows
        if (r.get("checkpointType") or "").endswith(RESUMABLE)
    }


def check_checkpoints(report: dict[str, Any], job_id: str, steps: range, lora: bool) -> None:
    """A resumable row per step on the control plane, named as the recipe saved it, under
    the job, typed LoRA or full; a promotable (sampler) row from the final save;
    `dataloader.json` keyed on those names with the rows consumed (4 a step)."""
    rows = report["checkpoints"]
    names = resumable_names(rows)
    assert {f"step-{s}" for s in steps} <= names, rows
    kind = "_TRAINING_LORA" if lora else "_TRAINING"
    resumable = [r for r in rows if r["name"].rsplit("/", 1)[-1] in names]
    assert all(r["checkpointType"].endswith(kind) for r in resumable), rows
    assert all(r["name"].startswith("accounts/") and f"/{job_id}/" in r["name"] for r in rows)
    assert any(r.get("promotable") for r in rows), rows
    loader = report["dataloader"]
    for s in steps:
        assert loader.get(f"step-{s}") == 4 * s, loader


@pytest.mark.parametrize("lora_rank", MODES)
def test_sft_loop_runs_and_resumes(
    cookbook_py: Path,
    cookbook: Path,
    fw_server: LiveServer,
    fw_models: dict[str, Path],
    tmp_path: Path,
    lora_rank: int,
) -> None:
    """`recipes/sft_loop.py`: one epoch (2 steps, an eval by `forward` after it), then the
    same run reattached to its trainer job with 2 epochs: it resumes at step 2 from the
    control plane's newest resumable checkpoint and `dataloader.json`, and runs steps 3-4."""
    phase: dict[str, Any] = {
        "recipe": "sft",
        "lora_rank": lora_rank,
        "learning_rate": 1e-2 if lora_rank else 1e-3,
    }
    args = (cookbook_py, fw_server, cookbook, fw_models[QWEN], tmp_path / "sft")
    first = run_phase(*args, phase="first", epochs=1, **phase)
    job_id = first["result"]["job_id"]
    assert first["result"]["steps"] == 2, first["result"]
    assert series(first["metrics"], "train/step") == [1, 2], first["metrics"]
    losses = series(first["metrics"], "train/ce_loss")
    assert finite(losses) and decreasing(losses), losses
    evals = series(first["metrics"], "eval/loss")
    assert finite(evals), first["metrics"]
    check_checkpoints(first, job_id, range(1, 3), lora=lora_rank > 0)

    second = run_phase(*args, phase="resume", epochs=2, job_id=job_id, **phase)
    assert second["result"] == {"steps": 4, "job_id": job_id}, second["result"]
    assert series(second["metrics"], "train/step") == [3, 4], second["metrics"]
    resumed = series(second["metrics"], "train/ce_loss")
    assert finite(resumed) and decreasing([*losses, *resumed]), (losses, resumed)
    # step 3's loss is measured on the weights of step 2's checkpoint, over the rows the first
    # run's closing eval scored on its final weights: the same number if those came back
    assert abs(resumed[0] - evals[-1]) < 1e-3 * max(1.0, evals[-1]), (resumed, evals)
    check_checkpoints(second, job_id, range(1, 5), lora=lora_rank > 0)


def test_sft_loop_runs_on_the_serverless_surface(
    cookbook_py: Path,
    cookbook: Path,
    fw_server: LiveServer,
    fw_models: dict[str, Path],
    tmp_path: Path,
) -> None:
    """`recipes/sft_loop.py` with `serverless=True` (the cookbook's `utils/serverless.py`): no
    trainer job; a `ts-` session's LoRA run, checkpoints listed on the session, and the final
    one promoted to a model through the session's promote route. The loss falls as on a job."""
    report = run_phase(
        cookbook_py,
        fw_server,
        cookbook,
        fw_models[QWEN],
        tmp_path / "sft-serverless",
        recipe="sft",
        phase="first",
        epochs=1,
        lora_rank=LORA_RANK,
        learning_rate=1e-2,
        serverless=True,
        output_model_id="sft-serverless",
    )
    result = report["result"]
    session = result["job_id"]
    assert result["steps"] == 2 and re.fullmatch(r"ts-[0-9a-f]{32}", session), result
    losses = series(report["metrics"], "train/ce_loss")
    assert finite(losses) and decreasing(losses), losses
    assert not trainer_jobs(report["calls"], "POST"), report["calls"]
    rows = report["checkpoints"]
    assert isinstance(rows, list) and rows, rows
    assert all(r["name"].startswith(f"accounts/local/trainingSessions/{session}/") for r in rows)
    assert any(r.get("promotable") for r in rows), rows
    promoted = [c for c in report["calls"] if re.search(r":promote \S+ 200", c)]
    assert len(promoted) == 1 and f"/trainingSessions/{session}/" in promoted[0], report["calls"]
    model = httpx.get(
        f"{fw_server.url}/v1/accounts/local/models/sft-serverless",
        headers={"Authorization": f"Bearer {fw_server.token}"},
    )
    assert model.status_code == 200, model.text
    assert f"trainingSessions/{session}" in model.text, model.text


def trainer_jobs(calls: list[str], method: str) -> list[str]:
    """The trainer jobs a run created (`POST`) or deleted (`DELETE`), from its REST calls."""
    pattern = {
        "POST": r"^POST \S+/rlorTrainerJobs\?\S*rlorTrainerJobId=([\w-]+)",
        "DELETE": r"^DELETE \S+/rlorTrainerJobs/([\w-]+) ",
    }[method]
    return [m.group(1) for call in calls if (m := re.match(pattern, call))]


DPO_MODES = [
    pytest.param(LORA_RANK, False, id="lora"),
    pytest.param(0, False, id="full"),
    pytest.param(0, True, id="full-kept-reference"),
]


@pytest.mark.parametrize(("lora_rank", "keep_reference"), DPO_MODES)
def test_dpo_loop_runs_and_resumes(
    cookbook_py: Path,
    cookbook: Path,
    fw_server: LiveServer,
    fw_models: dict[str, Path],
    tmp_path: Path,
    lora_rank: int,
    keep_reference: bool,
) -> None:
    """`recipes/dpo_loop.py`. The reference is the base model: a `base_only` client on the
    policy's trainer for a LoRA policy; for a full-parameter one a second (`forwardOnly`)
    trainer job, which the recipe deletes once its logprobs are cached (its default), or keeps
    for the resumed run to reattach (`full-kept-reference`, as the cookbook's own resume test
    does). Step 1's loss is exactly -log sigmoid(0) = ln 2 (policy = reference); the resumed
    run reattaches the policy's job, continues from step 2's weights (its first loss is below
    step 2's) and re-streams the data from the start (DPO keeps no cursor within an epoch)."""
    full_param = lora_rank == 0
    phase: dict[str, Any] = {
        "recipe": "dpo",
        "lora_rank": lora_rank,
        "learning_rate": 1e-2 if lora_rank else 1e-3,
        "epochs": 1,
        "keep_reference": keep_reference,
    }
    args = (cookbook_py, fw_server, cookbook, fw_models[QWEN], tmp_path / "dpo")
    first = run_phase(*args, phase="first", **phase)
    result = first["result"]
    job_id, reference = result["policy_job_id"], result["reference_job_id"]
    assert result["steps"] == 2, result
    created, deleted = trainer_jobs(first["calls"], "POST"), trainer_jobs(first["calls"], "DELETE")
    if not full_param:  # the shared base_only reference
        assert reference is None and created == [job_id] == deleted, (result, created, deleted)
    elif keep_reference:
        assert reference and sorted(created) == sorted([job_id, reference]), (result, created)
        assert deleted == [job_id], deleted
    else:  # the reference job, released once cached, then the policy's at close
        assert reference is None and len(created) == 2 and job_id in created, (result, created)
        assert sorted(deleted) == sorted(created) and deleted[-1] == job_id, deleted
    assert series(first["metrics"], "train/step") == [1, 2], first["metrics"]
    losses = series(first["metrics"], "train/dpo_loss")
    assert finite(losses) and len(losses) == 2, first["metrics"]
    assert abs(losses[0] - math.log(2)) < 1e-3, losses
    assert losses[1] < losses[0], losses
    check_checkpoints(first, job_id, range(1, 3), lora=not full_param)

    second = run_phase(*args, phase="resume", job_id=job_id, reference_job_id=reference, **phase)
    assert second["result"]["steps"] == 4, second["result"]
    assert second["result"]["policy_job_id"] == job_id, second["result"]
    assert second["result"]["reference_job_id"] == reference, second["result"]
    assert series(second["metrics"], "train/step") == [3, 4], second["metrics"]
    resumed = series(second["metrics"], "train/dpo_loss")
    assert finite(resumed) and decreasing([*losses, *resumed]), (losses, resumed)
    margins = series(second["metrics"], "train/margin")
    assert finite(margins) and margins[-1] > 0, second["metrics"]
    rows = second["checkpoints"]
    assert {"step-3", "step-4"} <= resumable_names(rows), rows


def test_recipes_are_the_cookbooks(cookbook_py: Path, cookbook: Path) -> None:
    """The recipes import from the exported cookbook tree, on the versions the cookbook pins."""
    code = (
        "import sys, importlib.metadata as m\n"
        f"sys.path.insert(0, {str(cookbook)!r})\n"
        "import training.recipes.sft_loop as s, training.recipes.dpo_loop as d\n"
        "names = ('fireworks-ai', 'tinker', 'tinker-cookbook', 'transformers')\n"
        "print(*[m.version(n) for n in names], s.__file__, d.__file__)"
    )
    proc = subprocess.run(
        [str(cookbook_py), "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    fireworks, tinker, tinker_cookbook, transformers, *files = proc.stdout.split()
    assert (fireworks, tinker, tinker_cookbook, transformers) == (
        "1.2.9",
        "0.23.0",
        "0.4.3",
        "5.5.4",
    )
    assert all(Path(f).is_relative_to(cookbook / "training" / "recipes") for f in files), files


@pytest.mark.parametrize("lora_rank", MODES)
def test_orpo_loop_runs(
    cookbook_py: Path,
    cookbook: Path,
    fw_server: LiveServer,
    fw_models: dict[str, Path],
    tmp_path: Path,
    lora_rank: int,
) -> None:
    """`recipes/orpo_loop.py` on the DPO pairs: its client-side loss (the chosen answer's NLL
    plus the odds-ratio term) falls step by step, the odds favour the chosen answer more after
    a step, and the job's checkpoints are on the control plane as the other recipes' are."""
    phase: dict[str, Any] = {
        "recipe": "orpo",
        "lora_rank": lora_rank,
        "learning_rate": 1e-2 if lora_rank else 1e-3,
    }
    args = (cookbook_py, fw_server, cookbook, fw_models[QWEN], tmp_path / "orpo")
    report = run_phase(*args, phase="first", epochs=1, **phase)
    assert report["result"]["steps"] == 2, report["result"]
    losses = series(report["metrics"], "train/orpo_loss")
    assert finite(losses) and decreasing(losses), report["metrics"]
    odds = series(report["metrics"], "train/log_odds_ratio")
    assert finite(odds) and odds[-1] > odds[0], report["metrics"]
    check_checkpoints(report, report["result"]["job_id"], range(1, 3), lora=lora_rank > 0)
