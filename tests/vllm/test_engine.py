"""The vLLM backend on the engine: samples of LoRA and full-weight sessions on vLLM replicas
equal the in-process loop's at the same weights (greedy tokens exactly, logprobs within
1e-3), and the trainer's own forward of the sampled tokens, before and after optim-steps and
syncs of each kind; versions, NaN neighbours, adapter slots, a killed replica."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.helpers import model_input, random_batch, sample
from trainer.checkpoint.store import CheckpointStore
from trainer.contract.errors import OperationError
from trainer.contract.generation import GeneratorOptions
from trainer.contract.specs import (
    AdamParams,
    LoraConfig,
    LossConfig,
    ModelEntry,
    ResourceSpec,
    SamplingParams,
    SessionSpec,
)
from trainer.engine.replicas import ReplicaStartError
from trainer.engine.resource import ModelResource
from trainer.engine.session import TrainingSession

CE = LossConfig(type="cross_entropy")
SYNC = "WEIGHT_SYNC_TYPE_SYNCHRONOUS"
BACKGROUND = "WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH"
PROMPTS = [[2, 3, 4], [5, 6, 7, 8, 9], [10]]
TOL = 1e-3


def _resource(
    model_dir: Path,
    storage: Path,
    python: str | None,
    *,
    lora: bool = True,
    replicas: int = 1,
    **options: Any,
) -> ModelResource:
    generator = (
        GeneratorOptions(backend="vllm", python=python, dtype="float32", **options)
        if python
        else None
    )
    entry = ModelEntry(
        name="tiny",
        location=str(model_dir),
        max_seq_length=256,
        max_lora_rank=16,
        generator=generator,
    )
    spec = ResourceSpec(
        base_model="tiny",
        lora_enabled=lora,
        compute_config={"num_generator_replicas": replicas},
    )
    return ModelResource(entry, spec, CheckpointStore(storage), device="cpu")


@pytest.fixture(scope="module")
def lora_pair(vllm_model: Path, vllm_py: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A LoRA resource on vLLM and its in-process twin. The replica holds two adapters in a
    batch and three in its CPU cache, so more sessions than that evict and re-read adapters."""
    root = tmp_path_factory.mktemp("lora-pair")
    served = _resource(
        vllm_model, root / "vllm", vllm_py, max_loras=3, extra_engine_args={"max_cpu_loras": 3}
    )
    twin = _resource(vllm_model, root / "hf", None)
    yield served, twin
    served.close()
    twin.close()


def _session(resource: ModelResource, name: str, rank: int = 4, **lora: Any) -> TrainingSession:
    config = LoraConfig(rank=rank, seed=7, **lora)
    return resource.create_session(name, SessionSpec(lora_config=config))


def _train(session: TrainingSession, step: int, sync: str = SYNC) -> None:
    session.forward_backward(CE, random_batch(step, n=4, vocab=128, weights="ones"))
    session.optim_step(AdamParams(learning_rate=0.05))
    session.weights_sync(sync)


def _sample(session: TrainingSession, **params: Any) -> dict[str, Any]:
    params = {"max_tokens": 12, "temperature": 0.0, **params}
    return session.sample(
        [model_input(p) for p in PROMPTS],
        num_samples=params.pop("n", 1),
        sampling_params=SamplingParams(**params),
    )


def _sequences(result: dict[str, Any]) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt, tokens, logprobs) of each sequence, prompt by prompt."""
    return [
        (prompt, seq["tokens"], seq["logprobs"])
        for prompt, got in zip(PROMPTS, result["results"], strict=True)
        for seq in got["sequences"]
    ]


def _forward_logprobs(
    session: TrainingSession, prompt: list[int], tokens: list[int]
) -> list[float]:
    """The trainer's logprobs of `tokens` after `prompt` (a forward at its current weights)."""
    seq = prompt + tokens
    probe = sample(seq[:-1], seq[1:], weights=[1.0] * (len(seq) - 1))
    out = session.forward_backward(CE, [probe], forward_only=True, return_loss_fn_outputs=True)
    logprobs = out["loss_fn_outputs"][0]["tensors"]["logprobs"]["data"]
    return list(logprobs[len(prompt) - 1 :])


def _assert_agrees(served: dict[str, Any], twin: dict[str, Any], session: TrainingSession) -> None:
    """Greedy tokens equal; logprobs within TOL of the in-process loop and the trainer."""
    for (prompt, tokens, lps), (_, want_tokens, want_lps) in zip(
        _sequences(served), _sequences(twin), strict=True
    ):
        assert tokens == want_tokens
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(want_lps), rtol=0, atol=TOL)
        forward = _forward_logprobs(session, prompt, tokens)
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(forward), rtol=0, atol=TOL)


def test_lora_samples_agree_with_the_in_process_loop_and_the_trainer(lora_pair: Any) -> None:
    served, twin = lora_pair
    a, b = _session(served, "a"), _session(twin, "a")
    _assert_agrees(_sample(a), _sample(b), a)  # step 0: the adapter is zero (the base model)
    for step in range(3):
        _train(a, step)
        _train(b, step)
        _assert_agrees(_sample(a), _sample(b), a)
    assert a.versions.applied_weights_version == 3
    assert served.generator_status()["replicas"][0]["state"] == "HEALTHY"


def test_an_adapter_on_the_tied_head_and_embeddings_is_served(lora_pair: Any) -> None:
    """`train_unembed` on a tied model: LoRA on `lm_head` and `embed_tokens`."""
    served, twin = lora_pair
    a = _session(served, "u", rank=8, train_unembed=True)
    b = _session(twin, "u", rank=8, train_unembed=True)
    for step in range(2):
        _train(a, 10 + step)
        _train(b, 10 + step)
    _assert_agrees(_sample(a), _sample(b), a)


def test_a_seed_gives_the_same_tokens_and_sampled_logprobs_match_the_trainer(
    lora_pair: Any,
) -> None:
    served, _ = lora_pair
    s = _session(served, "seeded")
    _train(s, 20)
    params = {"temperature": 1.0, "top_k": 20, "top_p": 0.9, "seed": 1234, "n": 3}
    first, again = _sample(s, **params), _sample(s, **params)
    assert _sequences(first) == _sequences(again)
    other = _sample(s, **{**params, "seed": 99})
    assert _sequences(other) != _sequences(first)
    rows = _sequences(first)
    assert len({tuple(t) for _, t, _ in rows}) > 1  # the three samples of a prompt differ
    for prompt, tokens, lps in rows:
        forward = _forward_logprobs(s, prompt, tokens)
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(forward), rtol=0, atol=TOL)


def test_background_publish_serves_the_new_version_at_the_next_sample(lora_pair: Any) -> None:
    served, twin = lora_pair
    a, b = _session(served, "bg"), _session(twin, "bg")
    _train(a, 30)
    _train(b, 30)
    _train(a, 31, BACKGROUND)
    _train(b, 31, BACKGROUND)
    assert a.versions.applied_weights_version == 1 and a.versions.target_weights_version == 2
    got = _sample(a)
    assert a.versions.applied_weights_version == 2
    assert all(r["policy_segments"] == [{"start_token": 0, "version": 2}] for r in got["results"])
    _assert_agrees(got, _sample(b), a)


def test_prompt_logprobs_are_the_trainers(lora_pair: Any) -> None:
    served, twin = lora_pair
    a, b = _session(served, "pl"), _session(twin, "pl")
    _train(a, 40)
    _train(b, 40)
    kwargs = {"num_samples": 1, "prompt_logprobs": True, "topk_prompt_logprobs": 3}
    inputs = [model_input(p) for p in PROMPTS]
    got = a.sample(inputs, sampling_params=SamplingParams(max_tokens=2), **kwargs)
    want = b.sample(inputs, sampling_params=SamplingParams(max_tokens=2), **kwargs)
    for g, w in zip(got["results"], want["results"], strict=True):
        torch.testing.assert_close(
            torch.tensor(g["prompt_logprobs"]), torch.tensor(w["prompt_logprobs"])
        )
        assert [t["token_ids"] for t in g["topk_prompt_logprobs"]] == [
            t["token_ids"] for t in w["topk_prompt_logprobs"]
        ]


def test_many_sessions_at_once_with_more_adapters_than_slots(lora_pair: Any) -> None:
    """Six sessions (one never trained: the base model) sample at once on a replica that holds
    two adapters in a batch and three in its cache: every sample equals its in-process twin's
    (evicted adapters are read again from their files); no adapter leaks into another row's,
    nor into the base model's. Then each samples again, alone, in reverse order."""
    served, twin = lora_pair
    pairs = [
        (_session(served, f"m{i}", rank=2 + i), _session(twin, f"m{i}", rank=2 + i))
        for i in range(6)
    ]
    for i, (a, b) in enumerate(pairs[1:]):
        _train(a, 50 + i)
        _train(b, 50 + i)
    with ThreadPoolExecutor(len(pairs)) as pool:
        got = list(pool.map(lambda p: _sample(p[0]), pairs))
    for (a, b), result in zip(pairs, got, strict=True):
        _assert_agrees(result, _sample(b), a)
    for a, b in reversed(pairs):
        _assert_agrees(_sample(a), _sample(b), a)


def test_a_nan_session_fails_alone_on_vllm(lora_pair: Any) -> None:
    served, twin = lora_pair
    bad, good = _session(served, "nan"), _session(served, "fine")
    ref = _session(twin, "fine")
    _train(good, 60)
    _train(ref, 60)
    _train(bad, 61)
    with torch.no_grad():
        for tensor in bad.policy.trainable.values():
            tensor.fill_(float("nan"))
    bad.weights_sync(SYNC)
    rng = bad.cpu_rng.clone()
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(_sample, s, temperature=1.0) for s in (bad, good)]
        failure, result = futures[0].exception(), futures[1].result()
    assert isinstance(failure, OperationError) and failure.code == "NON_FINITE_LOSS"
    assert torch.equal(bad.cpu_rng, rng)
    _assert_agrees(_sample(good), _sample(ref), good)
    assert result["results"]


@pytest.fixture
def full_pair(vllm_model: Path, vllm_py: str, tmp_path: Path) -> Any:
    """A full-weight resource on vLLM and its in-process twin, each with one session."""
    served = _resource(vllm_model, tmp_path / "vllm", vllm_py, lora=False)
    twin = _resource(vllm_model, tmp_path / "hf", None, lora=False)
    yield (
        served,
        twin,
        served.create_session("f", SessionSpec()),
        twin.create_session("f", SessionSpec()),
    )
    served.close()
    twin.close()


def test_full_weight_samples_agree_after_in_place_syncs(full_pair: Any) -> None:
    served, _twin, a, b = full_pair
    _assert_agrees(_sample(a), _sample(b), a)
    for step in range(3):
        _train(a, 70 + step)
        _train(b, 70 + step)
        _assert_agrees(_sample(a), _sample(b), a)
    assert served.replicas is not None and len(served.replicas.sync_seconds) >= 3


def test_a_killed_replica_fails_its_samples_and_comes_back(full_pair: Any) -> None:
    served, _twin, a, b = full_pair
    _train(a, 80)
    _train(b, 80)
    pool = served.replicas
    assert pool is not None
    pid = pool.replicas[0].pid
    assert pid is not None
    threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()
    with pytest.raises(OperationError) as caught:
        _sample(a, max_tokens=240, n=64)
    assert caught.value.code == "INTERNAL_ERROR" and "replica 0 died" in str(caught.value)
    deadline = time.monotonic() + 120
    while pool.replicas[0].state != "HEALTHY" and time.monotonic() < deadline:
        time.sleep(0.2)
    status = served.generator_status()["replicas"][0]
    assert status["state"] == "HEALTHY" and status["restarts"] == 1
    # the restarted replica serves the trained weights, not the base model's
    _assert_agrees(_sample(a), _sample(b), a)
    served.close()
    assert pool.replicas[0].process is not None and pool.replicas[0].process.poll() is not None


def test_a_replica_that_cannot_start_names_vllms_reason(vllm_py: str, tmp_path: Path) -> None:
    """A head size vLLM's CPU attention lacks is an unsupported feature: the resource samples
    in-process and its status says why (`test_families.py`); no interpreter fails it."""
    from trainer.tiny import TinySpec, save_model

    narrow = save_model(TinySpec(vocab=64, head_dim=16), tmp_path / "narrow")
    resource = _resource(narrow, tmp_path / "s1", vllm_py)
    try:
        status = resource.generator_status()
        assert status["backend"] == "hf" and resource.replicas is None
        assert "model type 'qwen3'" in status["fallback"] and "head_dim=16" in status["fallback"]
    finally:
        resource.close()
    with pytest.raises(ReplicaStartError, match="cannot run"):
        _resource(narrow, tmp_path / "s2", str(tmp_path / "no-such-python"))


def test_stop_tokens_end_a_sequence_as_in_process(lora_pair: Any) -> None:
    """A stop token ends the row with STOP_REASON_STOP and stays in its tokens, as in-process."""
    served, twin = lora_pair
    a, b = _session(served, "stop"), _session(twin, "stop")
    _train(a, 90)
    _train(b, 90)
    greedy = _sequences(_sample(b))
    stop = greedy[0][1][3]  # the 4th greedy token of the first prompt
    got, want = _sample(a, stop_token_ids=[stop]), _sample(b, stop_token_ids=[stop])
    _assert_agrees(got, want, a)
    first = got["results"][0]["sequences"][0]
    assert first["tokens"][-1] == stop and first["stop_reason"] == "STOP_REASON_STOP"
    assert len(first["tokens"]) <= 4


def test_stop_strings_on_a_model_with_a_tokenizer(
    vllm_py: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """vLLM initialises the model's tokenizer and stops on a stop string where the in-process
    loop does (the decoded text of the row's tokens contains it)."""
    from tests.tinker.conftest import VOCAB, build_tokenizer
    from trainer.tiny import TinySpec, save_model

    root = tmp_path_factory.mktemp("worded")
    spec = TinySpec(vocab=len(VOCAB), head_dim=32, tied=True, bos=None, eos=None, scale=4.0)
    model = build_tokenizer(save_model(spec, root / "model"))
    served = _resource(model, root / "vllm", vllm_py)
    twin = _resource(model, root / "hf", None)
    try:
        a, b = _session(served, "w"), _session(twin, "w")
        greedy = _sequences(_sample(b))
        word = twin.tokenizer.decode([greedy[0][1][2]])
        got, want = _sample(a, stop=[word]), _sample(b, stop=[word])
        _assert_agrees(got, want, a)
        assert got["results"][0]["sequences"][0]["stop_reason"] == "STOP_REASON_STOP"
    finally:
        served.close()
        twin.close()


def test_routing_replay_samples_run_on_the_in_process_loop(lora_pair: Any) -> None:
    """`return_routed_experts` samples go to the in-process loop (vLLM 0.32 returns no routes):
    the replica serves none of them, and a seeded sample at temperature 1 equals the in-process
    twin's token for token."""
    served, twin = lora_pair
    a, b = _session(served, "replay"), _session(twin, "replay")
    _train(a, 95)
    _train(b, 95)
    assert served.replicas is not None
    before = served.replicas.replicas[0].samples
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=3)
    inputs = [model_input(p) for p in PROMPTS]
    got = a.sample(inputs, num_samples=2, sampling_params=params, return_routed_experts=True)
    want = b.sample(inputs, num_samples=2, sampling_params=params, return_routed_experts=True)
    assert got == want
    assert served.replicas.replicas[0].samples == before
