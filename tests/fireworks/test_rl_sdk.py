"""The Fireworks RL loop through the official SDK, unchanged (`sdk_scripts/rl_grpo.py`): the
README's lifecycle example (a deployment, a trainer job with `hot_load_deployment_id`,
`FiretitanServiceClient`, `WeightSyncer.save_and_hotload`), then GRPO steps that sample the
deployment with `DeploymentSampler.sample_with_prompt_tokens(logprobs=True)`.

Checked: every completion after the hot-load of step N carries the logprobs of step N's weights
(the trainer's `forward` of the same tokens, within 1e-3 in float32); each step's
policy-gradient loss on its own batch goes down; the deployment reports the last identity.
Both families, LoRA and full weights, on both SDK lines.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.api.conftest import LiveServer
from tests.fireworks.conftest import LLAMA, QWEN, SCRIPTS, run_fw

pytestmark = pytest.mark.fireworks

STEPS = 3
CASES = [
    pytest.param(QWEN, 4, "dep-qwen-lora", id="qwen-lora"),
    pytest.param(LLAMA, 0, "dep-llama-full", id="llama-full"),
]


@pytest.mark.parametrize(("model", "rank", "deployment"), CASES)
def test_grpo_through_deployment(
    fw_python: Path,
    fw_server: LiveServer,
    fw_models: dict[str, Path],
    model: str,
    rank: int,
    deployment: str,
) -> None:
    name = f"{deployment}-{fw_python.parent.parent.name[-6:]}".lower()
    argv = [str(SCRIPTS / "rl_grpo.py"), model, str(rank), name, str(fw_models[model])]
    out = run_fw(fw_python, fw_server, [*argv, str(STEPS)], timeout=600)

    assert out["max_gap"] <= 1e-3, out["max_gap"]
    identities = out["identities"]
    assert len(identities) == STEPS + 1 and all(identities), identities
    assert len(set(identities)) == len(identities), identities
    replica = out["status"]["replicas"][0]
    loaded = {a["identity"] for a in replica.get("loaded_adapters") or []}
    assert replica["readiness"], replica
    assert identities[-1] in {replica["current_snapshot_identity"], *loaded}, replica
    moved = [(b, a) for b, a in zip(out["loss_before"], out["loss_after"], strict=True) if b]
    assert moved, out
    assert all(a < b for b, a in moved), moved
