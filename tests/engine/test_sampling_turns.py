"""Sampling that does not block: a sample yields the compute lock every K decode steps
(`[engine] decode_steps_per_turn`, `trainer/compute/turns.py`), so other sessions' operations run in
between, and its tokens, logprobs and session state stay what they are without yielding.
Concurrent samples of several sessions run as one generation batch (`[engine] batch_samples`,
`trainer/engine/batching/sample_batch.py`), each equal to the session's solo sample."""

from __future__ import annotations

import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.helpers import assert_same, model_input, random_batch, weights_of
from trainer.checkpoint.store import CheckpointStore
from trainer.compute.turns import TurnLock
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
VOCAB = 16  # the demo's model: hidden 64, 2 layers, 4 heads, 16 tokens


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo-sized model, without an EOS token: every sample runs to max_tokens."""
    spec = TinySpec(vocab=VOCAB, eos=None, max_positions=2048, scale=4.0)
    return save_model(spec, tmp_path_factory.mktemp("demo-model"))


def _resource(model_dir: Path, storage: Path, steps_per_turn: int) -> ModelResource:
    entry = ModelEntry(name="demo", location=str(model_dir), max_seq_length=2048)
    spec = ResourceSpec(
        base_model="demo", lora_enabled=True, compute_config={"num_generator_replicas": 1}
    )
    options = EngineOptions(decode_steps_per_turn=steps_per_turn)
    return ModelResource(entry, spec, CheckpointStore(storage), device="cpu", options=options)


def _batch(seed: int, n: int = 4, tokens: int = 32) -> list[Any]:
    return random_batch(seed, n=n, vocab=VOCAB, lengths=(tokens, tokens), weights="ones")


def _sessions(resource: ModelResource) -> tuple[TrainingSession, TrainingSession]:
    """Two trained and published sessions: their adapters differ from each other and from
    the base, so running a step on the wrong one would change the numbers."""
    s1 = resource.create_session("a", SessionSpec(lora_config=LoraConfig(rank=8, seed=1)))
    s2 = resource.create_session(
        "b", SessionSpec(lora_config=LoraConfig(rank=4, alpha=16, dropout=0.1, seed=2))
    )
    for seed, session in enumerate((s1, s2)):
        session.forward_backward(CE, _batch(seed))
        session.optim_step(AdamParams(learning_rate=0.05))
        session.weights_sync(SYNC)
    return s1, s2


def _lock(resource: ModelResource) -> TurnLock:
    assert isinstance(resource.lock, TurnLock)
    return resource.lock


def _wait_until_held(lock: TurnLock) -> None:
    deadline = time.monotonic() + 30
    while not lock.locked():
        assert time.monotonic() < deadline, "the sample never took the lock"
        time.sleep(0.001)


# -- the lock --------------------------------------------------------------------------------


def _queue_up(lock: TurnLock, name: str, order: list[str]) -> threading.Thread:
    """A thread that waits for the lock, records `name` once it has it, and lets go; returns
    once it is queued."""
    before = lock.waiting

    def run() -> None:
        with lock:
            order.append(name)

    thread = threading.Thread(target=run)
    thread.start()
    while lock.waiting == before:
        time.sleep(0.001)
    return thread


def test_turn_lock_serves_waiters_in_arrival_order_and_yields_to_them() -> None:
    lock = TurnLock()
    order: list[str] = []
    with lock:
        assert not lock.yield_turn()  # nobody waits: nothing to hand over
        threads = [_queue_up(lock, name, order) for name in ("t1", "t2", "t3")]
        with lock:  # re-entrant; held twice, it is not given away (an outer holder's turn)
            assert not lock.yield_turn() and order == []
        assert lock.held_here()
        assert lock.yield_turn()  # every earlier waiter runs, then the turn comes back
        assert order == ["t1", "t2", "t3"]
        late = _queue_up(lock, "t4", order)
        order.append("holder")
    late.join()
    for thread in threads:
        thread.join()
    assert order == ["t1", "t2", "t3", "holder", "t4"]
    assert not lock.locked() and not lock.held_here() and lock.handoffs == 1


def test_a_timed_out_waiter_leaves_the_queue() -> None:
    lock = TurnLock()
    got: list[bool] = []
    with lock:
        waiter = threading.Thread(target=lambda: got.append(lock.acquire(timeout=0.05)))
        waiter.start()
        waiter.join()
        assert got == [False] and lock.waiting == 0
        assert not lock.yield_turn()
    assert lock.acquire(blocking=False)
    lock.release()


# -- fairness --------------------------------------------------------------------------------


def _race(resource: ModelResource, s1: TrainingSession, s2: TrainingSession, tokens: int):
    """Session 1 samples `tokens` tokens; once it is under way, session 2 runs a small
    forward-backward (4 x 32 tokens). Returns (its latency, when it ended, when the sample
    ended, turns handed over)."""
    lock = _lock(resource)
    handoffs = lock.handoffs
    params = SamplingParams(max_tokens=tokens, seed=3)

    def sample() -> tuple[dict[str, Any], float]:
        result = s1.sample([model_input([2, 3])], sampling_params=params)
        return result, time.perf_counter()  # when the sample itself ended, in its thread

    with ThreadPoolExecutor(1) as pool:
        job = pool.submit(sample)
        _wait_until_held(lock)
        time.sleep(0.02)  # a few decode steps in
        start = time.perf_counter()
        s2.forward_backward(CE, _batch(7))
        fb_end = time.perf_counter()
        result, sample_end = job.result()
    assert len(result["results"][0]["sequences"][0]["tokens"]) == tokens
    return fb_end - start, fb_end, sample_end, lock.handoffs - handoffs


def test_a_small_forward_backward_does_not_wait_out_another_sessions_sample(
    demo_dir: Path, tmp_path: Path
) -> None:
    """The bound comes from figures measured here: the forward-backward alone, and one
    decode step (a solo sample / its length). With turns every K steps, the forward-backward
    waits at most for the current K steps, then runs: bound = 4 x (it alone) + 4 x (K steps).
    The same race with turns off (K = 0, the behaviour before) waits out the whole sample."""
    K, tokens = 16, 512
    resource = _resource(demo_dir, tmp_path, K)
    s1, s2 = _sessions(resource)
    s1.sample([model_input([2, 3])], sampling_params=SamplingParams(max_tokens=64))  # warm-up
    alone = []
    for _ in range(3):
        start = time.perf_counter()
        s2.forward_backward(CE, _batch(7))
        alone.append(time.perf_counter() - start)
    start = time.perf_counter()
    s1.sample([model_input([2, 3])], sampling_params=SamplingParams(max_tokens=tokens, seed=3))
    sample_alone = time.perf_counter() - start
    step = sample_alone / tokens
    bound = 4 * statistics.median(alone) + 4 * K * step
    assert bound < sample_alone / 2, (bound, sample_alone)  # the test can tell the two apart

    latency, fb_end, sample_end, handoffs = _race(resource, s1, s2, tokens)
    assert handoffs >= 1
    assert latency < bound, (latency, bound, sample_alone)
    assert fb_end < sample_end

    s1.options = EngineOptions(decode_steps_per_turn=0)  # the control: the behaviour before
    latency_off, fb_end_off, sample_end_off, handoffs_off = _race(resource, s1, s2, tokens)
    assert handoffs_off == 0
    assert fb_end_off > sample_end_off, latency_off  # it waited out the whole sample


# -- the numbers -----------------------------------------------------------------------------


PROMPTS = [model_input([2, 3, 4]), model_input([5, 6, 7, 8, 9])]
SEEDED = SamplingParams(max_tokens=96, temperature=0.9, top_k=12, seed=5)
UNSEEDED = SamplingParams(max_tokens=96)  # the seed is drawn from the session's RNG stream


def _s2_op(s2: TrainingSession, i: int) -> dict[str, Any]:
    """One of session 2's operations (its adapter active, train mode, dropout drawn)."""
    if i % 3 == 2:
        return s2.optim_step(AdamParams(learning_rate=0.01))
    return s2.forward_backward(CE, _batch(100 + i), return_loss_fn_outputs=True)


def _state(session: TrainingSession) -> dict[str, Any]:
    return {
        "trainable": weights_of(session),
        "published": {n: t.detach().clone() for n, t in session.policy.published_tensors().items()},
        "rng": session.cpu_rng.clone(),
    }


def _assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert_same(a["trainable"], b["trainable"])
    assert_same(a["published"], b["published"])
    assert torch.equal(a["rng"], b["rng"])


def test_samples_are_bit_identical_with_other_sessions_interleaved(
    demo_dir: Path, tmp_path: Path
) -> None:
    """Reference: turns off, each operation alone (the behaviour before). Interleaved: a turn
    every 2 decode steps while session 2 runs forward-backwards and optim-steps and a third
    session is created. Session 1's samples (seeded, and seeded from its own RNG stream) are
    equal bit for bit, and so are both sessions' states and session 2's results."""
    ref = _resource(demo_dir, tmp_path / "ref", 0)
    r1, r2 = _sessions(ref)
    expected = [r1.sample(PROMPTS, num_samples=2, sampling_params=p) for p in (SEEDED, UNSEEDED)]

    live = _resource(demo_dir, tmp_path / "live", 2)
    s1, s2 = _sessions(live)
    lock = _lock(live)
    got: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    with ThreadPoolExecutor(1) as pool:
        for params in (SEEDED, UNSEEDED):
            job = pool.submit(s1.sample, PROMPTS, num_samples=2, sampling_params=params)
            _wait_until_held(lock)
            for _ in range(4):  # a few turns are enough (each is a handoff mid-sample)
                if job.done():
                    break
                results.append(_s2_op(s2, len(results)))
                if len(results) == 2 and "c" not in live.sessions:
                    live.create_session("c", SessionSpec(lora_config=LoraConfig(rank=2, seed=9)))
            got.append(job.result())
    assert lock.handoffs >= 2, "nothing ran in between"
    assert len(results) >= 3

    assert got == expected  # tokens, logprobs, stop reasons, policy segments
    for result in got:
        for group in result["results"]:
            assert group["policy_segments"] == [{"start_token": 0, "version": 1}]
    # session 2, replayed alone after the samples, gives the same results and state
    if "c" not in ref.sessions:
        ref.create_session("c", SessionSpec(lora_config=LoraConfig(rank=2, seed=9)))
    replay = [_s2_op(r2, i) for i in range(len(results))]
    assert replay == results
    _assert_same_state(_state(s1), _state(r1))
    _assert_same_state(_state(s2), _state(r2))


def test_an_interleaved_sample_equals_the_same_sample_without_turns(
    demo_dir: Path, tmp_path: Path
) -> None:
    """Same resource, same session: a sample that yields its turn to another session's
    training ops equals the sample that yields nothing, and leaves session 1 as it was."""
    resource = _resource(demo_dir, tmp_path, 1)
    s1, s2 = _sessions(resource)
    before = _state(s1)
    params = SamplingParams(max_tokens=64, seed=11)
    s1.options = EngineOptions(decode_steps_per_turn=0)
    alone = s1.sample(PROMPTS, num_samples=3, sampling_params=params, prompt_logprobs=True)
    s1.options = EngineOptions(decode_steps_per_turn=1)
    lock = _lock(resource)
    handoffs = lock.handoffs
    ops = 0
    with ThreadPoolExecutor(1) as pool:
        job = pool.submit(
            s1.sample, PROMPTS, num_samples=3, sampling_params=params, prompt_logprobs=True
        )
        _wait_until_held(lock)
        while not job.done() and ops < 4:
            s2.forward_backward(CE, _batch(200 + ops))
            ops += 1
        interleaved = job.result()
    assert lock.handoffs > handoffs and ops >= 1
    assert interleaved == alone
    _assert_same_state(_state(s1), before)


# -- batched sampling across sessions --------------------------------------------------------

# (lora config, prompts, num_samples, sampling params, prompt logprobs) per session
JOBS = [
    (
        LoraConfig(rank=8, seed=1),
        [[2, 3, 4]],
        2,
        SamplingParams(max_tokens=40, seed=5),
        False,
    ),
    (
        LoraConfig(rank=4, alpha=16, seed=2, train_unembed=False),
        [[5, 6, 7, 8, 9, 10, 11], [3]],
        3,
        SamplingParams(max_tokens=56, temperature=0.7, top_k=20),  # seed from the session
        True,
    ),
    (
        LoraConfig(rank=2, alpha=8, seed=3),
        [[4, 4]],
        1,
        SamplingParams(max_tokens=24, top_p=0.8, seed=9, stop_token_ids=[7]),
        False,
    ),
]


def _jobs_resource(model_dir: Path, storage: Path, batch: bool) -> tuple[ModelResource, list]:
    """Three trained sessions with different ranks, alphas and heads; session 1's last
    weights-sync is a BACKGROUND_PUBLISH that its sample applies."""
    entry = ModelEntry(name="tiny", location=str(model_dir), max_seq_length=256)
    spec = ResourceSpec(
        base_model="tiny", lora_enabled=True, compute_config={"num_generator_replicas": 1}
    )
    options = EngineOptions(batch_samples=batch, merge_window_ms=300.0)
    resource = ModelResource(entry, spec, CheckpointStore(storage), device="cpu", options=options)
    sessions = []
    for i, (config, *_rest) in enumerate(JOBS):
        session = resource.create_session(f"s{i}", SessionSpec(lora_config=config))
        session.forward_backward(CE, random_batch(i, n=4, lengths=(6, 20), weights="ones"))
        session.optim_step(AdamParams(learning_rate=0.05))
        session.weights_sync(SYNC if i else "WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH")
        sessions.append(session)
    return resource, sessions


def _sample_job(session: TrainingSession, i: int) -> dict[str, Any]:
    _, prompts, n, params, with_prompt_logprobs = JOBS[i]
    return session.sample(
        [model_input(p) for p in prompts],
        num_samples=n,
        sampling_params=params,
        prompt_logprobs=with_prompt_logprobs,
    )


def _concurrently(sessions: list[TrainingSession]) -> list[Any]:
    """Every session's sample at once, each from its own thread (as their queues do);
    returns each one's result or exception."""
    with ThreadPoolExecutor(len(sessions)) as pool:
        futures = [pool.submit(_sample_job, s, i) for i, s in enumerate(sessions)]
        return [f.exception() or f.result() for f in futures]


def _assert_equal_samples(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Tokens, stop reasons, versions and prompt logprobs exactly; sampled logprobs to the
    rounding of a differently padded batch (a row padded in the batch but not alone takes
    another attention kernel path: measured differences up to 1e-6 on one CPU, 4.9e-6 on an
    AMD EPYC)."""
    assert len(got["results"]) == len(want["results"])
    for g, w in zip(got["results"], want["results"], strict=True):
        assert g.keys() == w.keys()
        assert g["policy_segments"] == w["policy_segments"]
        assert g.get("prompt_logprobs") == w.get("prompt_logprobs")
        for gs, ws in zip(g["sequences"], w["sequences"], strict=True):
            assert gs["tokens"] == ws["tokens"] and gs["stop_reason"] == ws["stop_reason"]
            torch.testing.assert_close(
                torch.tensor(gs["logprobs"]), torch.tensor(ws["logprobs"]), rtol=1e-6, atol=1e-5
            )


def test_concurrent_samples_of_sessions_run_as_one_batch_equal_to_their_solo_samples(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Tied (Qwen3-shaped) and untied (Llama-shaped) models; a head LoRA on two sessions."""
    from trainer.engine.batching.sample_batch import sample_counters

    solo_resource, solo = _jobs_resource(tiny_model_dir, tmp_path / "solo", batch=False)
    want = [_sample_job(s, i) for i, s in enumerate(solo)]
    assert solo_resource.sample_batcher is None

    resource, sessions = _jobs_resource(tiny_model_dir, tmp_path / "batched", batch=True)
    got = _concurrently(sessions)
    batcher = resource.sample_batcher
    assert (batcher.batches, batcher.batched_jobs) == (1, 3)  # one generation for all three
    assert sample_counters(resource) == {"sample_batches": 1, "batched_samples": 3}
    assert sample_counters(solo_resource) == {"sample_batches": 0, "batched_samples": 0}
    for g, w in zip(got, want, strict=True):
        _assert_equal_samples(g, w)
    for s, r in zip(sessions, solo, strict=True):
        assert s.versions == r.versions  # session 1's pending publish applied, as alone
        _assert_same_state(_state(s), _state(r))  # RNG streams moved as alone

    # again, the batch yielding its turn every 2 decode steps to another session's training
    want = [_sample_job(s, i) for i, s in enumerate(solo)]
    other = resource.create_session("x", SessionSpec(lora_config=LoraConfig(rank=4, seed=7)))
    other.options = EngineOptions(merge_window_ms=0.0)  # straight to the lock
    for session in sessions:
        session.options = EngineOptions(merge_window_ms=300.0, decode_steps_per_turn=2)
    lock = _lock(resource)
    handoffs, ops = lock.handoffs, 0
    with ThreadPoolExecutor(1) as pool:
        job = pool.submit(_concurrently, sessions)
        _wait_until_held(lock)
        while not job.done() and ops < 3:
            other.forward_backward(CE, _batch(300 + ops, tokens=8))
            ops += 1
        got = job.result()
    assert batcher.batches == 2 and lock.handoffs > handoffs and ops >= 1
    for g, w in zip(got, want, strict=True):
        _assert_equal_samples(g, w)


def test_a_failed_batch_fails_every_sample_in_it_and_leaves_each_session_as_it_was(
    tiny_qwen_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error mid-generation (injected into the token choice after 20 draws): all three
    samples fail with it; each session keeps its RNG stream, weights, versions and pending
    publish. The same samples then succeed as one batch."""
    from trainer.compute import draws

    resource, sessions = _jobs_resource(tiny_qwen_dir, tmp_path, batch=True)
    before = [(_state(s), s.versions.as_dict()) for s in sessions]
    real = draws._choose
    calls = [0]

    def fail_late(*args: Any) -> Any:  # an error mid-generation, after some draws
        calls[0] += 1
        if calls[0] > 20:
            raise RuntimeError("injected failure")
        return real(*args)

    monkeypatch.setattr(draws, "_choose", fail_late)
    errors = _concurrently(sessions)
    assert all(isinstance(e, RuntimeError) and "injected" in str(e) for e in errors), errors
    for session, (state, versions) in zip(sessions, before, strict=True):
        _assert_same_state(_state(session), state)
        assert session.versions.as_dict() == versions  # the pending publish still pending
    assert before[0][1]["pending_publish"]
    monkeypatch.setattr(draws, "_choose", real)
    again = _concurrently(sessions)  # and the same samples then succeed, as one batch
    assert resource.sample_batcher.batches == 1
    assert all(isinstance(result, dict) for result in again), again
    assert again[0]["results"][0]["policy_segments"] == [{"start_token": 0, "version": 1}]
    assert sessions[0].versions.as_dict() == {
        **before[0][1],
        "applied_weights_version": 1,
        "pending_publish": False,
    }
