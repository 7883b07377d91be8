"""The `together` SDK, unchanged, drives GRPO loops on a worker whose samples run on vLLM
replicas: versions advance, each sample's logprobs equal the trainer's forward of its tokens
within 1e-3, the resource reports its replicas, and a model vLLM cannot serve samples
in-process, its status naming the model type and vLLM's reason."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from together.post_training import ModelResourcesClient, SessionClient

from tests.api.api_helpers import model_input, tensor
from tests.api.conftest import TOKEN, LiveServer, serve_in_thread
from trainer.tiny import TinySpec, save_model

PPO = {
    "type": "LOSS_TYPE_PPO",
    "ppo_params": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
}
CE = {"type": "LOSS_TYPE_CROSS_ENTROPY"}
PROMPTS = [[3, 17, 42], [7, 7, 100, 2]]
GROUP = 4
TOL = 1e-3


@pytest.fixture(scope="module")
def server(
    vllm_model: Path, vllm_py: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    narrow = save_model(TinySpec(vocab=64, head_dim=16), tmp_path_factory.mktemp("narrow"))
    with serve_in_thread(
        tmp_path_factory.mktemp("storage"),
        {"tiny": vllm_model, "narrow": narrow},
        generator={"backend": "vllm", "python": vllm_py, "dtype": "float32"},
        resource_create_wait_s=120,
    ) as live:
        yield live


def _resource(server: LiveServer, lora: bool, base_model: str = "tiny") -> ModelResourcesClient:
    return ModelResourcesClient.create(
        api_key=TOKEN,
        base_url=server.api,
        base_model=base_model,
        lora_enabled=lora,
        inactive_timeout=600,
        interval=0.1,
    )


def _forward(session: SessionClient, sequence: list[int]) -> list[float]:
    sample = {
        "model_input": model_input(sequence[:-1]),
        "loss_fn_inputs": {
            "target_tokens": tensor(sequence[1:], "int64"),
            "weights": tensor([1.0] * (len(sequence) - 1)),
        },
    }
    out = session.trainer.forward(samples=[sample], loss=CE)
    assert out.loss_fn_outputs is not None
    return list(out.loss_fn_outputs[0].tensors["logprobs"].data)


def _grpo_step(session: SessionClient, step: int) -> None:
    """Sample a group per prompt on the replica, check its logprobs against the trainer's
    forward, then one PPO update on group-normalised rewards and a sync."""
    batch: list[dict[str, Any]] = []
    for p, prompt in enumerate(PROMPTS):
        result = session.generator.sample(
            model_input(prompt),
            num_samples=GROUP,
            sampling_params={"max_tokens": 8, "temperature": 1.0, "seed": 100 * step + p},
        )
        assert [s.version for s in result.policy_segments] == [step]
        rewards = []
        for seq in result.sequences:
            tokens = [int(t) for t in seq.tokens]
            assert len(tokens) == 8 and seq.logprobs is not None
            forward = _forward(session, prompt + tokens)[len(prompt) - 1 :]
            assert max(abs(a - b) for a, b in zip(forward, seq.logprobs, strict=True)) <= TOL
            rewards.append(sum(t < 64 for t in tokens) / len(tokens))
        mean = sum(rewards) / len(rewards)
        for seq, reward in zip(result.sequences, rewards, strict=True):
            tokens = [int(t) for t in seq.tokens]
            full = prompt + tokens
            pad = [0.0] * (len(prompt) - 1)
            batch.append(
                {
                    "model_input": model_input(full[:-1]),
                    "loss_fn_inputs": {
                        "target_tokens": tensor(full[1:], "int64"),
                        "logprobs": tensor(pad + list(seq.logprobs or [])),
                        "advantages": tensor(pad + [reward - mean] * len(tokens)),
                        "mask": tensor(pad + [1.0] * len(tokens)),
                    },
                }
            )
    session.trainer.forward_backward(samples=batch, loss=PPO)
    assert int(session.trainer.optim_step(adam_params={"learning_rate": 2e-2}).step) == step + 1
    assert int(session.trainer.weights_sync().weights_version) == step + 1


def _details(server: LiveServer, resource_id: str) -> dict[str, Any]:
    with server.client() as http:
        body: dict[str, Any] = http.get(f"/rl/model-resources/{resource_id}").json()
    return body


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_a_grpo_loop_samples_on_vllm(server: LiveServer, lora: bool) -> None:
    with _resource(server, lora) as resource:
        body = _details(server, resource.model_resources_id)
        generator = body["status_details"]["generator"]
        assert generator["backend"] == "vllm"
        assert [r["state"] for r in generator["replicas"]] == ["HEALTHY"]
        health = httpx.get(f"{server.url}/healthz").json()
        assert health["generator_replicas"]["healthy"] >= 1
        config = {"lora_config": {"rank": 8, "alpha": 16, "seed": 3}} if lora else {}
        session = resource.create_session(interval=0.05, **config)
        for step in range(3):
            _grpo_step(session, step)
        view = session.retrieve()
        assert int(view.policy_state.applied_weights_version) == 3
        session.stop()
    pid = generator["replicas"][0]["pid"]
    deadline = time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)  # stopping the resource stopped its replica


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_a_model_vllm_cannot_serve_samples_in_process_with_its_reason(
    server: LiveServer,
) -> None:
    """A head size vLLM's CPU attention lacks: the resource is READY, its status says it
    samples in-process and why, and its samples are the trainer's."""
    with _resource(server, lora=True, base_model="narrow") as resource:
        generator = _details(server, resource.model_resources_id)["status_details"]["generator"]
        assert generator["backend"] == "hf" and "replicas" not in generator
        assert "vLLM cannot serve model type 'qwen3'" in generator["fallback"]
        assert "head_dim=16" in generator["fallback"]
        session = resource.create_session(interval=0.05)
        prompt = [3, 17, 42]
        result = session.generator.sample(
            model_input(prompt),
            num_samples=1,
            sampling_params={"max_tokens": 4, "temperature": 1.0, "seed": 1},
        )
        tokens = [int(t) for t in result.sequences[0].tokens]
        forward = _forward(session, prompt + tokens)[len(prompt) - 1 :]
        logprobs = result.sequences[0].logprobs or []
        assert max(abs(a - b) for a, b in zip(forward, logprobs, strict=True)) <= TOL
        session.stop()
