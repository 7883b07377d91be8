"""MoE routing replay through the official `together` SDK: `sample(return_routed_experts=True)`
returns a key per sequence, and training samples carry it (docs/semantics.md §12), in a short GRPO
loop on a tiny Qwen3-MoE."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from api_helpers import model_input, tensor
from conftest import TOKEN, LiveServer, serve_in_thread
from together.post_training import ModelResourcesClient

from trainer.tiny import TinySpec, save_model

PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    spec = TinySpec(arch="qwen3_moe", scale=4.0, experts=4, experts_per_tok=2)
    model = save_model(spec, tmp_path_factory.mktemp("tiny-moe"), seed=3)
    with serve_in_thread(tmp_path_factory.mktemp("storage"), {"tiny-moe": model}) as live:
        yield live


def _sample(sequence: list[int], n_prompt: int, lps: list[float], adv: float, key: str | None):
    n = len(sequence) - 1
    mask = [0.0] * (n_prompt - 1) + [1.0] * (n - n_prompt + 1)
    out = {
        "model_input": model_input(sequence[:-1]),
        "loss_fn_inputs": {
            "target_tokens": tensor(sequence[1:], "int64"),
            "logprobs": tensor([0.0] * (n_prompt - 1) + lps),
            "advantages": tensor([adv] * n),
            "mask": tensor(mask),
        },
    }
    if key is not None:
        out["routed_experts_key"] = key
    return out


def test_grpo_loop_with_routed_experts_keys(moe_server: LiveServer, tmp_path: Path) -> None:
    with ModelResourcesClient.create(
        api_key=TOKEN,
        base_url=moe_server.api,
        base_model="tiny-moe",
        lora_enabled=True,
        inactive_timeout=600,
        interval=0.05,
    ) as resource:
        session = resource.create_session(lora_config={"rank": 4, "seed": 0}, interval=0.05)
        other = resource.create_session(lora_config={"rank": 4, "seed": 1}, interval=0.05)
        grpo = {"type": "LOSS_TYPE_GRPO"}
        for step in range(3):
            batch = []
            for prompt in PROMPTS:
                result = session.generator.sample(
                    model_input(prompt),
                    num_samples=2,
                    sampling_params={"max_tokens": 5, "temperature": 1.0, "seed": step},
                    return_routed_experts=True,
                )
                rewards = [float(len(s.tokens)) for s in result.sequences]
                mean = sum(rewards) / len(rewards)
                for seq, reward in zip(result.sequences, rewards, strict=True):
                    assert seq.routed_experts_key and seq.logprobs is not None
                    tokens = prompt + [int(t) for t in seq.tokens]
                    batch.append(
                        _sample(
                            tokens,
                            len(prompt),
                            list(seq.logprobs),
                            reward - mean,
                            seq.routed_experts_key,
                        )
                    )
            # at the sampling weights the replayed logprobs are the sampler's: ratio 1
            out = session.trainer.forward(samples=batch, loss=grpo)
            assert out.metrics["loss/ratio/mean"] == pytest.approx(1.0, abs=1e-5)
            session.trainer.forward_backward(samples=batch, loss=grpo)
            session.trainer.optim_step(adam_params={"learning_rate": 1e-2})
            session.trainer.weights_sync()
        with pytest.raises(Exception, match="routed_experts_key"):
            other.trainer.forward_backward(samples=batch[:1], loss=grpo)  # not its key
        plain = session.generator.sample(
            model_input(PROMPTS[0]), num_samples=1, sampling_params={"max_tokens": 3}
        )
        assert plain.sequences[0].routed_experts_key is None
        session.stop()
        other.stop()
    assert any((moe_server.storage / "routes").iterdir())
