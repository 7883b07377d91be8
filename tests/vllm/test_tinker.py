"""The official `tinker` SDK (0.38) runs an RL loop on a worker whose samples run on vLLM
(`tinker_rl.py`): the sampler's logprobs of its own tokens and `compute_logprobs` equal the
training client's forward within 1e-3, step after step, on a model with a tokenizer (vLLM
initialises it too)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.api.conftest import LiveServer, serve_in_thread
from tests.tinker.conftest import REPO, VOCAB, build_tokenizer, run_in_venv
from tests.tinker.test_stable_reinforce import check
from tests.tinker.venv import tinker_python
from trainer.tiny import TinySpec, save_model

HERE = Path(__file__).parent
BASE = "Qwen/Qwen3-8B"  # a name the SDK knows; the weights are a tiny Qwen3
TOL = 1e-3


@pytest.fixture(scope="module")
def server(vllm_py: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    model = tmp_path_factory.mktemp("tinker-vllm-model")
    spec = TinySpec(vocab=len(VOCAB), head_dim=32, tied=True, bos=None, eos=1, pad=0, scale=4.0)
    save_model(spec, model)
    build_tokenizer(model)
    with serve_in_thread(
        tmp_path_factory.mktemp("storage"),
        {},
        model=[{"name": BASE, "location": str(model)}],
        generator={"backend": "vllm", "python": vllm_py, "dtype": "float32"},
        resource_create_wait_s=120,
    ) as live:
        yield live


@pytest.fixture(scope="module")
def run(server: LiveServer) -> dict[str, Any]:
    return run_in_venv(tinker_python(), server, [str(HERE / "tinker_rl.py"), BASE], timeout=600)


def test_sampler_logprobs_equal_the_training_forward(run: dict[str, Any]) -> None:
    prompt = run["prompt"]
    for step in run["steps"]:
        for seq, forward in zip(step["sequences"], step["trainer"], strict=True):
            assert len(seq["tokens"]) >= 1
            got = seq["logprobs"]
            want = forward[len(prompt) - 1 :][: len(got)]
            assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= TOL


def test_compute_logprobs_equal_the_training_forward(run: dict[str, Any]) -> None:
    for step in run["steps"]:
        for computed, forward in zip(step["computed"], step["trainer"], strict=True):
            assert computed[0] is None
            assert max(abs(a - b) for a, b in zip(computed[1:], forward, strict=True)) <= TOL


def test_samplers_of_current_weights_open_no_engine_session(
    server: LiveServer, run: dict[str, Any]
) -> None:
    """Each step's sampler sampled on the training session (its adapter already in the
    replica); only the first sampler, asked again after later saves, opened one of its own,
    and it sampled its own checkpoint's weights: the same tokens and logprobs as at step 0."""
    assert server.app.state.tinker_samplers.opened == 1
    first = run["steps"][0]["sequences"]
    again = run["first_again"]
    assert [s["tokens"] for s in again] == [s["tokens"] for s in first]
    for a, b in zip(again, first, strict=True):
        assert max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"], strict=True)) <= TOL


def test_the_samples_ran_on_the_vllm_replica(server: LiveServer, run: dict[str, Any]) -> None:
    (live,) = server.worker.resources.live_resources()
    assert live.engine is not None
    (replica,) = live.engine.generator_status()["replicas"]
    assert replica["state"] == "HEALTHY"
    assert replica["samples"] >= len(run["steps"])


@pytest.fixture(scope="module")
def stable(server: LiveServer) -> dict[str, Any]:
    script = str(REPO / "tests" / "tinker" / "sdk_scripts" / "stable_reinforce.py")
    return run_in_venv(tinker_python(), server, [script, BASE], timeout=600)


def test_stable_reinforce_records_what_the_replica_returned(
    server: LiveServer, stable: dict[str, Any]
) -> None:
    """With samples from vLLM, the records hold the replica's own float32 logprobs (exactly
    what the SDK got back), and the loss is rule 13 on them (docs/semantics.md §13)."""
    db = sqlite3.connect(server.storage / "tinker_stability.sqlite")
    for seq in stable["sequences"]:
        (blob,) = db.execute(
            "SELECT logprobs FROM records WHERE sequence_id = ?", (seq["id"],)
        ).fetchone()
        recorded = np.frombuffer(blob, dtype="<f4")
        assert recorded.tolist() == np.asarray(seq["logprobs"], dtype=np.float32).tolist()
    config = stable["config"]
    on_policy = check(stable, stable["on_policy"], config["kl_coeff"], config["truncation"])
    assert abs(on_policy["diff"]) <= TOL  # vLLM's logprobs against the trainer's
    check(stable, stable["off_policy"], config["kl_coeff"], config["truncation"])
    assert all(stable["errors"][case] for case in ("unknown_id", "foreign_id", "not_recorded"))
