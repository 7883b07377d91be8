"""The control plane driven by the official SDK (both lines, `fw_python`): a job created and
waited for, a model trained through its gateway, its checkpoints listed and promoted, the job
deleted; and a job resumed after a worker restart."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.api.conftest import LiveServer, serve_in_thread
from tests.fireworks.conftest import QWEN, SCRIPTS, run_fw

pytestmark = pytest.mark.fireworks


def test_a_job_trains_through_its_gateway_and_its_checkpoint_is_promoted(
    fw_python: Path, fw_server: LiveServer
) -> None:
    model_id = f"sdk-{fw_python.parent.parent.name[-6:].lower()}"
    out = run_fw(fw_python, fw_server, [str(SCRIPTS / "cp_lifecycle.py"), QWEN, "8", model_id])
    assert out["state"] == "JOB_STATE_RUNNING"
    assert out["base_url"].endswith(f"/training/v1/rlorTrainerJobs/local/{out['job_id']}")
    assert out["max_context_length"] > 0
    assert out["moe"] is False
    assert out["after_delete"] == "JOB_STATE_CANCELLED"
    names = {r["name"].split("/")[-1]: r for r in out["checkpoints"]}
    if not names:  # the Tinker face does not open the job's models on the job's resource yet
        pytest.xfail("the Tinker face does not honour the job's Binding yet")
    assert names["step-1"]["checkpointType"] == "CHECKPOINT_TYPE_TRAINING_LORA"
    sampler = [r for r in out["checkpoints"] if r["promotable"]]
    assert sampler and sampler[-1]["checkpointType"] == "CHECKPOINT_TYPE_INFERENCE_LORA"
    assert out["promoted"]["name"] == f"accounts/local/models/{model_id}"
    assert out["promoted"]["kind"] == "HF_PEFT_ADDON"
    loaded = out["adapter_loaded"]  # load_adapter("accounts/local/models/<id>")
    if isinstance(loaded, str) and "inside this worker's storage" in loaded:
        pytest.xfail(
            "load_adapter opens a resolved model with resume_from_hf_checkpoint, which refuses "
            "directories inside the storage; a promoted model's adapter is a checkpoint's"
        )
    assert loaded is True


def test_the_sdk_reuses_an_existing_job_and_resumes_it_after_a_restart(
    fw_python_latest: Path, fw_models: dict[str, Path], tmp_path: Path
) -> None:
    storage = tmp_path / "storage"
    with serve_in_thread(storage, fw_models) as first:
        made = run_fw(fw_python_latest, first, [str(SCRIPTS / "cp_create.py"), QWEN, "4", "kept"])
    assert made == {"job_id": "kept", "again": "kept", "state": "JOB_STATE_RUNNING"}
    with serve_in_thread(storage, fw_models) as second:
        out = run_fw(fw_python_latest, second, [str(SCRIPTS / "cp_resume.py"), "kept"])
    assert out["before"] == "JOB_STATE_PAUSED" and out["after"] == "JOB_STATE_RUNNING"
