"""Routing replay through the official SDK (`together==3.1.1`), unchanged, on a tiny Qwen3-MoE.

A short GRPO loop on a live worker: each step samples with `return_routed_experts=True`, and
every sequence comes back with a `routed_experts_key`; the client relays each key with its
sequence into forward and forward-backward. At the weights that sampled them, the replayed
logprobs equal the sampler's (docs/semantics.md §12: ≤ 1e-5 in fp32); the loop trains (versions
move,
the weights change) and completes. A dense model ignores the flag and returns no key.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import together
from api_helpers import model_input, tensor
from conftest import TOKEN, LiveServer, serve_in_thread
from together.post_training import ModelResourcesClient, SessionClient

PROMPTS = [[3, 17, 42, 9], [7, 100, 2]]
GROUP = 3  # sequences per prompt
MAX_TOKENS = 6
GRPO = {
    "type": "LOSS_TYPE_GRPO",
    "grpo_params": {
        "clip_low_threshold": 0.8,
        "clip_high_threshold": 1.28,
        "agg_type": "GRPO_LOSS_AGGREGATION_TYPE_TOKEN_MEAN",
        "ratio_type": "GRPO_LOSS_RATIO_TYPE_TOKEN",
    },
}
CE = {"type": "LOSS_TYPE_CROSS_ENTROPY"}


@pytest.fixture(scope="module")
def moe_server(
    tiny_moe_dir: Path, tiny_qwen_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    models = {"tiny-moe": tiny_moe_dir, "tiny-qwen": tiny_qwen_dir}
    with serve_in_thread(tmp_path_factory.mktemp("moe-storage"), models) as live:
        yield live


def _resource(server: LiveServer, base_model: str, lora: bool = True) -> ModelResourcesClient:
    return ModelResourcesClient.create(
        api_key=TOKEN,
        base_url=server.api,
        base_model=base_model,
        lora_enabled=lora,
        inactive_timeout=600,
        interval=0.05,
    )


def _reward(tokens: list[int]) -> float:
    """Share of even tokens: anything the policy can move."""
    return sum(t % 2 == 0 for t in tokens) / max(1, len(tokens))


def _training_sample(
    prompt: list[int],
    tokens: list[int],
    sampled: list[float] | None,
    advantage: float,
    key: str | None,
) -> dict[str, Any]:
    """A GRPO sample, or with `sampled` None a cross-entropy one (forward: logprobs only)."""
    sequence = prompt + tokens
    n_prompt = len(prompt) - 1
    ones = [0.0] * n_prompt + [1.0] * len(tokens)
    inputs = {"target_tokens": tensor(sequence[1:], "int64")}
    if sampled is None:
        inputs["weights"] = tensor(ones)
    else:
        inputs["logprobs"] = tensor([0.0] * n_prompt + sampled)
        inputs["advantages"] = tensor([0.0] * n_prompt + [advantage] * len(tokens))
        inputs["mask"] = tensor(ones)
    out: dict[str, Any] = {"model_input": model_input(sequence[:-1]), "loss_fn_inputs": inputs}
    if key is not None:
        out["routed_experts_key"] = key
    return out


def _completion_logprobs(outputs: Any, prompts: list[int]) -> list[list[float]]:
    assert outputs is not None
    return [
        list(o.tensors["logprobs"].data)[n - 1 :] for o, n in zip(outputs, prompts, strict=True)
    ]


def _close(a: list[float], b: list[float], tol: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b))


def _grpo_step(session: SessionClient, step: int) -> dict[str, Any]:
    batch: list[tuple[list[int], list[int], list[float], str]] = []
    for p, prompt in enumerate(PROMPTS):
        result = session.generator.sample(
            model_input(prompt),
            num_samples=GROUP,
            sampling_params={"max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 10 * step + p},
            return_routed_experts=True,
        )
        assert [s.version for s in result.policy_segments] == [step]
        for seq in result.sequences:
            key = seq.routed_experts_key
            assert isinstance(key, str) and key.startswith("re-"), seq
            assert seq.logprobs is not None
            batch.append((prompt, [int(t) for t in seq.tokens], list(seq.logprobs), key))
    keys = [key for *_, key in batch]
    assert len(set(keys)) == len(keys), "one key per sequence"

    advantages: list[float] = []
    for p in range(len(PROMPTS)):
        rewards = [_reward(tokens) for _, tokens, _, _ in batch[p * GROUP : (p + 1) * GROUP]]
        mean = sum(rewards) / len(rewards)
        advantages += [r - mean for r in rewards]
    samples = [
        _training_sample(prompt, tokens, sampled, adv, key)
        for (prompt, tokens, sampled, key), adv in zip(batch, advantages, strict=True)
    ]
    scored = [_training_sample(prompt, tokens, None, 0.0, key) for prompt, tokens, _, key in batch]
    n_prompts = [len(prompt) for prompt, *_ in batch]
    sampled = [lp for _, _, lp, _ in batch]

    # at the weights that sampled them, a replayed forward gives the sampler's logprobs
    forward = session.trainer.forward(samples=scored, loss=CE)
    replayed = _completion_logprobs(forward.loss_fn_outputs, n_prompts)
    for got, want in zip(replayed, sampled, strict=True):
        assert _close(got, want, 1e-5), (got, want)

    out = session.trainer.forward_backward(samples=samples, loss=GRPO, return_loss_fn_outputs=True)
    assert out.loss_fn_outputs is not None
    trained = _completion_logprobs(out.loss_fn_outputs, n_prompts)
    for got, want in zip(trained, sampled, strict=True):
        assert _close(got, want, 1e-5), (got, want)
    assert out.metrics is not None
    ratio = out.metrics.get("loss/ratio/mean")
    assert ratio == pytest.approx(1.0, abs=1e-5)  # sampler and trainer agree: routing included

    assert int(session.trainer.optim_step(adam_params={"learning_rate": 5e-2}).step) == step + 1
    assert int(session.trainer.weights_sync().weights_version) == step + 1
    return {"samples": scored, "sampled": sampled, "prompts": n_prompts}


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_grpo_loop_with_routing_replay(moe_server: LiveServer, lora: bool) -> None:
    with _resource(moe_server, "tiny-moe", lora) as resource:
        config = {"lora_config": {"rank": 4, "alpha": 8, "seed": 0}} if lora else {}
        session = resource.create_session(interval=0.05, **config)  # type: ignore[arg-type]
        first = None
        for step in range(3):
            done = _grpo_step(session, step)
            first = first or done
        assert first is not None
        # the loop trained: step 0's sequences have other logprobs at the final weights, and a
        # replayed call still accepts their keys
        later = session.trainer.forward(samples=first["samples"], loss=CE)
        moved = _completion_logprobs(later.loss_fn_outputs, first["prompts"])
        assert not all(_close(a, b, 1e-4) for a, b in zip(moved, first["sampled"], strict=True))
        assert int(session.retrieve().step) == 3
        # the worker reads each key: one relayed with another sequence's tokens is refused
        # (the SDK raises its OperationFailedError, a RuntimeError, for a FAILED operation)
        swapped = dict(first["samples"][0])
        swapped["routed_experts_key"] = first["samples"][GROUP]["routed_experts_key"]
        with pytest.raises((RuntimeError, together.BadRequestError)) as info:
            session.trainer.forward(samples=[swapped], loss=CE)
        assert "routed_experts_key" in str(info.value)
        session.stop()


def test_dense_model_ignores_the_flag(moe_server: LiveServer) -> None:
    with _resource(moe_server, "tiny-qwen") as resource:
        session = resource.create_session(lora_config={"rank": 4, "seed": 0}, interval=0.05)
        result = session.generator.sample(
            model_input(PROMPTS[0]),
            num_samples=2,
            sampling_params={"max_tokens": 4, "seed": 1},
            return_routed_experts=True,
        )
        assert [s.routed_experts_key for s in result.sequences] == [None, None]
        session.stop()
