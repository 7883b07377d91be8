"""The README's Fireworks example (`scripts/fireworks_example.py`) runs as written, on both SDK
lines and both tiny families, LoRA and full weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.api.conftest import LiveServer
from tests.fireworks.conftest import LLAMA, QWEN, REPO, run_fw

pytestmark = pytest.mark.fireworks

EXAMPLE = str(REPO / "scripts" / "fireworks_example.py")
TOKENS = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]


def base_logprob_per_token(model_dir: Path) -> float:
    """The plain transformers forward of the example's sequence: mean target logprob."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([TOKENS[:-1]])
    with torch.no_grad():
        logprobs = model(ids).logits.float().log_softmax(-1)[0]
    picked = logprobs.gather(-1, torch.tensor(TOKENS[1:])[:, None])
    return float(picked.mean())


def test_lora_example(fw_python: Path, fw_server: LiveServer, fw_models: dict[str, Path]) -> None:
    out = run_fw(fw_python, fw_server, [EXAMPLE, "--model", QWEN, "--steps", "3"])
    assert len(out["losses"]) == 3 and out["losses"][-1] < out["losses"][0]
    reference = base_logprob_per_token(fw_models[QWEN])
    assert out["base_logprob_per_token"] == pytest.approx(reference, abs=1e-5)
    assert out["saved"].endswith("/example") and not out["saved"].startswith("tinker://")
    assert any(name.endswith("example") for name in out["checkpoints"])


def test_full_weight_example(fw_python_latest: Path, fw_server: LiveServer) -> None:
    argv = [EXAMPLE, "--model", LLAMA, "--rank", "0", "--steps", "3", "--lr", "1e-3"]
    out = run_fw(fw_python_latest, fw_server, argv)
    assert len(out["losses"]) == 3 and out["losses"][-1] < out["losses"][0]
    assert out["base_logprob_per_token"] is None
    assert any(name.endswith("example") for name in out["checkpoints"])
