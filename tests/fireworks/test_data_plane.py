"""The Firetitan data plane on the Tinker face: the Fireworks SDK's `FiretitanServiceClient`,
run in its own venv (both SDK lines where cheap), pointed straight at the worker.

Checked against references computed here: `forward` logprobs against a plain `transformers`
forward of each sequence alone, a resumed run (`load_state_with_optimizer` of the name
`save_state` returned) against the uninterrupted one bit for bit, the frozen base reference
against the base model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.api.conftest import LiveServer
from tests.fireworks.conftest import LLAMA, QWEN, SCRIPTS, run_fw
from tests.fireworks.venv import fireworks_python

pytestmark = pytest.mark.fireworks

SEQS = [[3, 17, 22, 9, 27, 5], [8, 21, 33, 30, 12]]


def reference_logprobs(model_dir: Path, seqs: list[list[int]]) -> list[list[float]]:
    """log p(t_{i+1} | t_{<=i}) of each sequence alone, by plain transformers in fp32."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for seq in seqs:
            ids = torch.tensor([seq[:-1]])
            logits = model(input_ids=ids).logits[0].float()
            lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]
            out.append(lp.tolist())
    return out


def close(a: list[list[float]], b: list[list[float]], tol: float = 2e-4) -> bool:
    return all(
        len(x) == len(y) and all(abs(u - v) <= tol for u, v in zip(x, y, strict=True))
        for x, y in zip(a, b, strict=True)
    )


def train(python: Path, server: LiveServer, model: str, rank: int) -> dict[str, Any]:
    return run_fw(
        python, server, [str(SCRIPTS / "dp_train.py"), model, str(rank), json.dumps(SEQS)]
    )


@pytest.mark.parametrize("model", [QWEN, LLAMA])
@pytest.mark.parametrize("rank", [4, 0])
def test_training_resumes_bit_for_bit_and_forward_matches_transformers(
    fw_python_latest: Path,
    fw_server: LiveServer,
    fw_models: dict[str, Path],
    model: str,
    rank: int,
) -> None:
    out = train(fw_python_latest, fw_server, model, rank)
    assert out["info"] == {"is_lora": rank > 0, "lora_rank": rank}, out["info"]
    reference = reference_logprobs(fw_models[model], SEQS)
    # LoRA B = 0 and full weights untouched: the first forward is the base model's
    assert close(out["forward"], reference), (out["forward"], reference)
    assert close(out["base_forward"], reference), (out["base_forward"], reference)
    assert "frozen reference" in out["base_fb"], out["base_fb"]
    losses = [s["loss"] for s in out["steps"]]
    assert losses[1] < losses[0], losses
    tokens = sum(len(s) - 1 for s in SEQS)
    assert out["steps"][0]["opt"]["grad_accumulation_scale"] == pytest.approx(1 / tokens)
    # resumed with the optimizer == uninterrupted, bit for bit
    assert out["resumed"] == out["continued"], (out["resumed"], out["continued"])
    assert out["saved_path"].endswith("/step-1"), out["saved_path"]
    assert out["saved_path"] in out["list"], out["list"]
    assert "grpo" in json.dumps(out["custom_metrics"]), out["custom_metrics"]
    assert out["sampler_path"] and not out["sampler_path"].startswith("tinker://")


def test_the_older_sdk_line_trains_resumes_and_forwards(
    fw_server: LiveServer, fw_models: dict[str, Path]
) -> None:
    """1.2.9 (the cookbook's pin: the `tinker` 0.23 package instead of `_core`)."""
    out = train(fireworks_python("1.2.9"), fw_server, QWEN, 2)
    assert close(out["forward"], reference_logprobs(fw_models[QWEN], SEQS))
    assert out["resumed"] == out["continued"]
    assert out["saved_path"] in out["list"]
