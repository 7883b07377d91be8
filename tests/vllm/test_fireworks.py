"""The Fireworks RL loop on a worker whose deployments sample on vLLM replicas: the SDK's
lifecycle example and GRPO steps (`tests/fireworks/sdk_scripts/rl_grpo.py`), unchanged. A
deployment follows the worker's `[generator]`, so its completions run on the replicas: after
each `WeightSyncer.save_and_hotload`, the completion's logprobs equal the trainer's forward of
the same tokens at the hot-loaded step (within 1e-3, float32). A streamed completion comes
from the replica as it generates: in several chunks, equal to the whole answer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.api.conftest import TOKEN, LiveServer, serve_in_thread
from tests.fireworks.conftest import QWEN, SCRIPTS, run_fw
from tests.fireworks.test_completions import assembled, complete, stream
from tests.fireworks.venv import fireworks_python
from tests.tinker.conftest import VOCAB, build_tokenizer
from trainer.api.fireworks import completion_run
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


def test_a_stream_from_a_vllm_deployment_comes_as_it_is_made(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(completion_run, "FLUSH_S", 0.0)  # a chunk per replica step
    name = "accounts/local/deployments/stream-vllm"
    with httpx.Client(base_url=server.url, headers={"X-Api-Key": TOKEN}, timeout=300) as http:
        created = http.post(
            "/v1/accounts/local/deployments",
            params={"deploymentId": "stream-vllm"},
            json={"baseModel": QWEN, "deploymentShape": "local"},
        )
        assert created.status_code == 200, created.text
        body = {"model": name, "prompt": [3, 17, 22, 9], "max_tokens": 24, "temperature": 0.0}
        body.update(logprobs=True, raw_output=True)
        whole = complete(http, **body)
        _, chunks = stream(http, **body)
        assert http.delete("/v1/accounts/local/deployments/stream-vllm").status_code == 200
    assert chunks[-1] == "[DONE]"
    (expected,) = whole["choices"]
    (got,) = assembled(chunks[:-1])
    assert got["raw_output"] == expected["raw_output"]
    assert got["content"] == expected["logprobs"]["content"]
    tokens = expected["raw_output"]["completion_token_ids"]
    deltas = [c for c in chunks[:-2] if isinstance(c, dict) and c["choices"]]
    assert len(tokens) >= 3 and len(deltas) >= 3, (tokens, deltas)  # not one chunk at the end
    engine = server.worker.resources.live
    assert any(getattr(live.engine, "replicas", None) for live in engine.values()), engine
