"""`save_weights_for_sampler(checkpoint_type="merged_base")`: a LoRA adapter folded into the base
weights, listed as `CHECKPOINT_TYPE_INFERENCE_BASE`, promoted as an `HF_BASE_MODEL` and deployed
as a full model (docs/semantics.md §22, §23). The cookbook's own
`examples/tools/merge_lora_and_promote.py` runs unchanged in its venv, on both families: a LoRA
session loads a PEFT adapter (a local directory under `resume_roots` where the example expects
`gs://`), saves it `merged_base`, waits for it to be promotable, promotes it and waits for a
READY `HF_BASE_MODEL` without `peftDetails`. The model's deployment then serves plain
transformers' logprobs of peft's `merge_and_unload()` of that adapter: rounded to bf16 when the
save asks `export_precision="bf16"`, whose decision calibration is the checkpoint's
`decision.json`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.api.conftest import LiveServer, serve_in_thread
from tests.cached_venv import run_json
from tests.fireworks.conftest import LLAMA, QWEN, SCRIPTS, fw_env, run_fw
from tests.fireworks.test_control_plane import KEYS, client, write_keys
from tests.fireworks.test_data_plane import close, reference_logprobs
from tests.fireworks.test_deployments import BODY, settled
from tests.fireworks.test_deployments_sdk import SEQS, deployment_logprobs
from tests.tinker import tinker_http as th
from trainer.serving.tenants import Principal

pytestmark = pytest.mark.fireworks


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("merged-adapters")


@pytest.fixture(scope="module")
def live(
    fw_models: dict[str, Path], adapters: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    ring = write_keys(tmp_path_factory.mktemp("merged-keys") / "keys.toml")
    storage = tmp_path_factory.mktemp("merged-storage")
    with serve_in_thread(storage, fw_models, keys=ring, resume_roots=[str(adapters)]) as server:
        yield server


def adapter_and_reference(base_dir: Path, out: Path, merged: Path) -> list[list[float]]:
    """A random PEFT adapter of the base model saved to `out` (B non-zero), and plain
    transformers' logprobs of `SEQS` under its `merge_and_unload()`."""
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=2, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    peft_model = get_peft_model(base, config)
    peft_model.save_pretrained(out)
    peft_model.merge_and_unload().save_pretrained(merged)
    return reference_logprobs(merged, SEQS)


@pytest.mark.parametrize("base", [QWEN, LLAMA])
def test_the_cookbooks_merge_and_promote_gives_a_deployable_base_model(
    live: LiveServer,
    fw_models: dict[str, Path],
    adapters: Path,
    cookbook_py: Path,
    cookbook: Path,
    tmp_path: Path,
    base: str,
) -> None:
    stem = base.rsplit("/", 1)[1]
    adapter = adapters / stem
    want = adapter_and_reference(fw_models[base], adapter, tmp_path / "merged")
    assert not close(want, reference_logprobs(fw_models[base], SEQS))  # the adapter matters
    model_id = f"{stem}-merged"
    argv = [str(SCRIPTS / "merge_promote.py"), base, str(adapter), "2", model_id, "mb"]
    out = run_json(cookbook_py, argv, fw_env(live, KEYS["alice"]), 600, cookbook)
    name = f"accounts/alice/models/{model_id}"
    model = out["model"]
    assert model["name"] == name and model["state"] == "READY", model
    assert model["kind"] == "HF_BASE_MODEL" and "peftDetails" not in model, model
    assert out["checkpoint"]["checkpointType"] == "CHECKPOINT_TYPE_INFERENCE_BASE", out
    assert out["checkpoint"]["promotable"], out

    c = client(live, "alice")
    made = c.post(
        "/v1/accounts/alice/deployments",
        params={"deploymentId": stem, "skipShapeValidation": "true"},
        json={**BODY, "baseModel": name, "minReplicaCount": 1},
    )
    assert made.status_code == 200, made.text
    replica = settled(c, "alice", stem)
    assert replica["loading_state"]["stage"] == "done", replica
    identity, got = deployment_logprobs(
        live, f"accounts/alice/deployments/{stem}", Principal("alice")
    )
    assert identity == name
    assert close(got, want), (got, want)
    c.delete(f"/v1/accounts/alice/deployments/{stem}")


def test_a_bf16_merged_base_deploys_its_rounded_weights(
    live: LiveServer,
    fw_models: dict[str, Path],
    adapters: Path,
    fw_python_latest: Path,
    tmp_path: Path,
) -> None:
    """`export_precision="bf16"` with a decision calibration (SDK 1.2.30): the merged files are
    bf16, the calibration is `decision.json`, and the promoted model's deployment serves those
    files' numbers: the float32 merge rounded to bf16, not the float32 merge itself."""
    adapter = adapters / "qwen-bf16"
    exact = adapter_and_reference(fw_models[QWEN], adapter, tmp_path / "merged")
    rounded = tmp_path / "merged-bf16"
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    merged.to(torch.bfloat16).save_pretrained(rounded)
    want = reference_logprobs(rounded, SEQS)
    assert not close(want, exact)  # the rounding shows
    argv = [str(SCRIPTS / "merge_export.py"), QWEN, str(adapter), "2", "qwen-bf16", "bf16", "1.5"]
    out = run_fw(fw_python_latest, live, argv, 600, KEYS["alice"])
    assert out["model"]["kind"] == "HF_BASE_MODEL", out
    (decision,) = live.storage.rglob("decision.json")
    assert json.loads(decision.read_text()) == {
        "contract": "systemone-letter-v1",
        "objective": "nll",
        "temperature": {"choice": 1.5},
        "fit_rows": {},
        "metrics": {},
    }
    files = load_file(str(decision.parent / "merged" / "model.safetensors"))
    assert {t.dtype for t in files.values()} == {torch.bfloat16}

    c = client(live, "alice")
    name = "accounts/alice/models/qwen-bf16"
    body = {**BODY, "baseModel": name, "minReplicaCount": 1}
    made = c.post(
        "/v1/accounts/alice/deployments",
        params={"deploymentId": "qwen-bf16", "skipShapeValidation": "true"},
        json=body,
    )
    assert made.status_code == 200, made.text
    assert settled(c, "alice", "qwen-bf16")["loading_state"]["stage"] == "done"
    _, got = deployment_logprobs(live, "accounts/alice/deployments/qwen-bf16", Principal("alice"))
    assert close(got, want), (got, want)
    c.delete("/v1/accounts/alice/deployments/qwen-bf16")


def _tinker(live: LiveServer) -> httpx.Client:
    headers = {"X-API-Key": KEYS["alice"], "User-Agent": "AsyncTinker/Python 0.23.0"}
    return httpx.Client(base_url=f"{live.url}{th.PREFIX}", headers=headers, timeout=120)


def _model(http: httpx.Client, rank: int) -> str:
    session = th.new_session(http)
    body: dict[str, Any] = {"session_id": session, "model_seq_id": 0, "base_model": QWEN}
    return str(th.ok(http, "/create_model", {**body, "lora_config": {"rank": rank}})["model_id"])


def test_merged_base_on_a_full_weight_model_is_a_400(live: LiveServer) -> None:
    """`merged_base` folds an adapter: a full-weight model has none to fold."""
    with _tinker(live) as http:
        save = {"model_id": _model(http, 0), "path": "mb", "checkpoint_type": "merged_base"}
        response = http.post("/save_weights_for_sampler", json=save)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "checkpoint_type"


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"export_precision": "bf16"}, "export_precision", "merged_base"),
        (
            {"checkpoint_type": "merged_base", "export_precision": "nvfp4"},
            "export_precision",
            "quantized",
        ),
        (
            {"checkpoint_type": "merged_base", "export_precision": "fp4"},
            "export_precision",
            "one of",
        ),
        (
            {"metadata": {"decision_calibration": {"temperature": {"choice": 0}}}},
            "metadata",
            "greater",
        ),
        (
            {"metadata": {"decision_calibration": {"temperature": {"yesno": 1.0}}}},
            "metadata",
            "noul",
        ),
        ({"metadata": {"other": 1}}, "metadata", "xtra"),
    ],
    ids=["not-merged", "quantized", "unknown", "temperature", "question-type", "unknown-key"],
)
def test_export_precision_and_metadata_are_checked(
    live: LiveServer, extra: dict[str, Any], param: str, words: str
) -> None:
    """Refused before anything is written: a 400 naming the field, no checkpoint."""
    before = sorted(live.storage.rglob("state.json"))
    with _tinker(live) as http:
        model_id = _model(http, 2)
        response = http.post("/save_weights_for_sampler", json={"model_id": model_id, **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].startswith(param) and words in error["message"], error
    assert sorted(live.storage.rglob("state.json")) == before
