"""The Fireworks RL loop on a worker whose deployments sample on vLLM replicas: the SDK's
lifecycle example and GRPO steps (`tests/fireworks/sdk_scripts/rl_grpo.py`), unchanged. A
deployment follows the worker's `[generator]`, so its completions run on the replicas: after
each `WeightSyncer.save_and_hotload`, the completion's logprobs equal the trainer's forward of
the same tokens at the hot-loaded step (within 1e-3, float32)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.api.conftest import LiveServer, serve_in_thread
from tests.fireworks.conftest import QWEN, SCRIPTS, run_fw
from tests.fireworks.venv import fireworks_python
from tests.tinker.conftest import VOCAB, build_tokenizer
from trainer.tiny import TinySpec, save_model

pytestmark = pytest.mark.fireworks


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("fw-vllm-model")
    spec = TinySpec(vocab=len(VOCAB), head_dim=32, tied=True, bos=None, eos=1, pad=0, scale=4.0)
    save_model(spec, where)
    build_tokenizer(where)
    return where


@pytest.fixture(scope="module")
def server(
    vllm_py: str, model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    with serve_in_thread(
        tmp_path_factory.mktemp("storage"),
        {},
        model=[{"name": QWEN, "location": str(model)}],
        generator={"backend": "vllm", "python": vllm_py, "dtype": "float32"},
        resource_create_wait_s=120,
    ) as live:
        yield live


def test_grpo_through_a_vllm_deployment(server: LiveServer, model: Path) -> None:
    argv = [str(SCRIPTS / "rl_grpo.py"), QWEN, "4", "dep-vllm", str(model), "2"]
    out = run_fw(fireworks_python(), server, argv, timeout=900)
    assert out["max_gap"] <= 1e-3, out["max_gap"]
    identities = out["identities"]
    assert len(identities) == 3 and all(identities), identities
    replica = out["status"]["replicas"][0]
    loaded = {a["identity"] for a in replica.get("loaded_adapters") or []}
    assert identities[-1] in {replica["current_snapshot_identity"], *loaded}, replica
    # the completions ran on the replicas, not the in-process loop
    engine = server.worker.resources.live
    assert any(getattr(live.engine, "replicas", None) for live in engine.values()), engine
