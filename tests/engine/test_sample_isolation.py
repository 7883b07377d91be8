"""Shared sampling isolates tenants: a session whose published weights produce non-finite
logits fails its own samples alone (NON_FINITE_LOSS) while its batch neighbours get exactly
their solo tokens, and a batched sample returns as soon as its own rows are done, not when the
longest job of its batch is."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.helpers import model_input, random_batch
from trainer.checkpoint.store import CheckpointStore
from trainer.contract.errors import OperationError
from trainer.contract.options import EngineOptions
from trainer.contract.specs import (
    AdamParams,
    LoraConfig,
    LossConfig,
    ModelEntry,
    ResourceSpec,
    SamplingParams,
    SessionSpec,
)
from trainer.engine.resource import ModelResource
from trainer.engine.session import TrainingSession
from trainer.tiny import TinySpec, save_model

CE = LossConfig(type="cross_entropy")
SYNC = "WEIGHT_SYNC_TYPE_SYNCHRONOUS"
VOCAB = 16
# the heavy neighbour: 64 rows (32 samples of each of 2 prompts) x 1,500 tokens
LONG_ROWS, LONG_TOKENS = 32, 1500
POSITIONS = 1536  # a 3-token prompt and 1,500 sampled tokens fit
# the long sample's solo reference is taken on its first PREFIX tokens: seeded sampling draws
# the same tokens whatever max_tokens is, and the whole solo run would double the test's time
PREFIX = 200
WINDOW_S = 0.3  # the batch's merge window: both samples join one batch


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo-sized model, without an EOS token: every sample runs to max_tokens."""
    spec = TinySpec(vocab=VOCAB, eos=None, max_positions=POSITIONS, scale=4.0)
    return save_model(spec, tmp_path_factory.mktemp("demo-model"))


def _resource(model_dir: Path, storage: Path, batch: bool, sessions: int) -> ModelResource:
    """`sessions` trained and published LoRA sessions `s0`, `s1`, ... (different adapters)."""
    entry = ModelEntry(name="demo", location=str(model_dir), max_seq_length=POSITIONS)
    spec = ResourceSpec(
        base_model="demo", lora_enabled=True, compute_config={"num_generator_replicas": 1}
    )
    options = EngineOptions(batch_samples=batch, merge_window_ms=WINDOW_S * 1000)
    resource = ModelResource(entry, spec, CheckpointStore(storage), device="cpu", options=options)
    for i in range(sessions):
        config = LoraConfig(rank=2 + 2 * (i % 3), seed=i)
        session = resource.create_session(f"s{i}", SessionSpec(lora_config=config))
        session.forward_backward(
            CE, random_batch(i, n=4, vocab=VOCAB, lengths=(6, 20), weights="ones")
        )
        session.optim_step(AdamParams(learning_rate=0.05))
        session.weights_sync(SYNC)
    return resource


def _session(resource: ModelResource, i: int) -> TrainingSession:
    return resource.sessions[f"s{i}"]


def _poison(session: TrainingSession) -> None:
    """The session's published adapter turned to NaN (what an absurd update once left)."""
    with torch.no_grad():
        for tensor in session.policy.published_tensors().values():
            tensor.fill_(float("nan"))


def _params(i: int, tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, seed=100 + i, temperature=0.9)


def _sample(session: TrainingSession, i: int, tokens: int, rows: int = 2) -> dict[str, Any]:
    prompts = [model_input([2 + i % 5, 3, 4]), model_input([5, 6 + i % 7])]
    return session.sample(prompts, num_samples=rows, sampling_params=_params(i, tokens))


def _assert_same_sample(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Tokens and stop reasons exactly; logprobs to a differently padded batch's rounding."""
    for g, w in zip(got["results"], want["results"], strict=True):
        assert g["policy_segments"] == w["policy_segments"]
        for gs, ws in zip(g["sequences"], w["sequences"], strict=True):
            assert gs["tokens"] == ws["tokens"] and gs["stop_reason"] == ws["stop_reason"]
            torch.testing.assert_close(
                torch.tensor(gs["logprobs"]), torch.tensor(ws["logprobs"]), rtol=1e-6, atol=3e-6
            )


def test_a_nan_neighbour_fails_alone_and_the_others_get_their_solo_samples(
    demo_dir: Path, tmp_path: Path
) -> None:
    """Eight sessions sample at once, every other one with NaN weights: the four hostile
    samples fail with NON_FINITE_LOSS (their sessions' RNG streams unmoved), the four others
    equal their solo samples on a twin resource, all in one generation batch."""
    n, bad = 8, {1, 3, 5, 7}
    solo = _resource(demo_dir, tmp_path / "solo", batch=False, sessions=n)
    want = {i: _sample(_session(solo, i), i, 24) for i in range(n) if i not in bad}
    resource = _resource(demo_dir, tmp_path / "batched", batch=True, sessions=n)
    for i in bad:
        _poison(_session(resource, i))
    rng_before = {i: _session(resource, i).cpu_rng.clone() for i in bad}
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(_sample, _session(resource, i), i, 24) for i in range(n)]
        got = [f.exception() or f.result() for f in futures]
    assert resource.sample_batcher is not None and resource.sample_batcher.batches == 1
    for i in range(n):
        if i in bad:
            assert isinstance(got[i], OperationError), got[i]
            assert got[i].code == "NON_FINITE_LOSS" and "weights" in str(got[i])
            assert torch.equal(_session(resource, i).cpu_rng, rng_before[i])
        else:
            _assert_same_sample(got[i], want[i])
            assert torch.equal(_session(resource, i).cpu_rng, _session(solo, i).cpu_rng)


def test_a_nan_session_sampling_alone_fails_with_non_finite_loss(
    demo_dir: Path, tmp_path: Path
) -> None:
    resource = _resource(demo_dir, tmp_path, batch=False, sessions=1)
    _poison(_session(resource, 0))
    with pytest.raises(OperationError) as caught:
        _sample(_session(resource, 0), 0, 8)
    assert caught.value.code == "NON_FINITE_LOSS"


def test_samples_record_no_autograd_graph(demo_dir: Path, tmp_path: Path) -> None:
    """Every forward of a sample, alone or batched, runs with autograd off. With it on, the
    solo path kept each decode step's graph: 3.7 GB for one 64 x 600-token sample against
    0.47 GB batched, and 64 x 1,500 tokens ran out of memory."""
    for batch in (False, True):
        resource = _resource(demo_dir, tmp_path / f"batch-{batch}", batch=batch, sessions=2)
        modes: list[bool] = []
        hook = resource.model.register_forward_hook(
            lambda *_, modes=modes: modes.append(torch.is_grad_enabled())
        )
        try:
            with ThreadPoolExecutor(2) as pool:
                jobs = [pool.submit(_sample, _session(resource, i), i, 8) for i in range(2)]
                for job in jobs:
                    job.result()
        finally:
            hook.remove()
        assert modes and not any(modes), (batch, modes)
    assert resource.sample_batcher is not None and resource.sample_batcher.batches == 1


def _prefix(result: dict[str, Any], tokens: int) -> dict[str, Any]:
    """`result` with every sequence cut to its first `tokens` tokens (stop reasons kept)."""
    return {
        **result,
        "results": [
            {
                **group,
                "sequences": [
                    {**seq, "tokens": seq["tokens"][:tokens], "logprobs": seq["logprobs"][:tokens]}
                    for seq in group["sequences"]
                ],
            }
            for group in result["results"]
        ],
    }


def test_a_short_batched_sample_returns_before_the_long_one_it_ran_with(
    demo_dir: Path, tmp_path: Path
) -> None:
    """A 2-token sample batched with a 64 x 1,500-token one returns in a small fraction of the
    long one's time; it equals its solo sample, and the long one equals its solo sample on its
    first PREFIX tokens (every row runs to 1,500: the model has no EOS)."""
    solo = _resource(demo_dir, tmp_path / "solo", batch=False, sessions=2)
    want_long = _sample(_session(solo, 0), 0, PREFIX, rows=LONG_ROWS)
    want_short = _sample(_session(solo, 1), 1, 2)
    resource = _resource(demo_dir, tmp_path / "batched", batch=True, sessions=2)
    ends: dict[str, float] = {}

    def timed(name: str, i: int, tokens: int, rows: int) -> dict[str, Any]:
        result = _sample(_session(resource, i), i, tokens, rows)
        ends[name] = time.perf_counter()
        return result

    start = time.perf_counter()
    with ThreadPoolExecutor(2) as pool:
        long = pool.submit(timed, "long", 0, LONG_TOKENS, LONG_ROWS)
        short = pool.submit(timed, "short", 1, 2, 2)
        got_short, got_long = short.result(), long.result()
    assert resource.sample_batcher is not None and resource.sample_batcher.batches == 1
    # both wait out the batch's window first: the fraction is of the decoding after it, so a
    # faster machine cannot fail it
    short_s, long_s = ends["short"] - start - WINDOW_S, ends["long"] - start - WINDOW_S
    assert short_s < 0.05 * long_s, (short_s, long_s)
    _assert_same_sample(got_short, want_short)
    rows = [seq for group in got_long["results"] for seq in group["sequences"]]
    assert len(rows) == 2 * LONG_ROWS
    assert all(len(seq["tokens"]) == LONG_TOKENS for seq in rows)
    _assert_same_sample(_prefix(got_long, PREFIX), want_long)
