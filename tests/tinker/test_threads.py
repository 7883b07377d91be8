"""Threads and engine sessions of the Tinker face come back.

- Idle dispatchers end: 300 sampling sessions created and used (the SDK's RL pattern makes
  one per step) leave the thread count near where it was; a later request starts its owner's
  dispatcher again.
- Heartbeat expiry reclaims everything of the silent session: its models' engine sessions,
  the sampler sessions only it used, their threads.
- 16 concurrent clients sampling from more checkpoints than stay open (eviction under load)
  all get their samples; `SamplerSessions` never hands out a session it is closing, nor fails
  with a `KeyError`, under 16 racing threads.
"""

from __future__ import annotations

import random
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import httpx

from tests.api.conftest import LiveServer
from tests.tinker import tinker_http as th
from trainer.api.tinker import sampling
from trainer.api.tinker.records import TinkerModel, TinkerSampler, TinkerSession
from trainer.serving.catalogue import SES_RUNNING, SessionRow


def prompt_body(**target: Any) -> dict[str, Any]:
    return {
        **target,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
        "sampling_params": {"max_tokens": 1, "seed": 0},
    }


def settles(check: Callable[[], bool], timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def quiet_thread_count() -> int:
    """The thread count once it has not changed for half a second (threads of earlier
    requests have ended)."""
    count = threading.active_count()
    stable_since = time.monotonic()
    while time.monotonic() - stable_since < 0.5:
        time.sleep(0.05)
        if threading.active_count() != count:
            count, stable_since = threading.active_count(), time.monotonic()
    return count


def test_300_samplers_leave_no_threads(live: LiveServer, http: httpx.Client) -> None:
    session = th.new_session(http)
    th.ok(http, "/asample", prompt_body(base_model=th.BASE))  # warm: the sampler session opens
    baseline = quiet_thread_count()

    def use(seq: int) -> None:
        with th.client(live) as client:
            body = {"session_id": session, "sampling_session_seq_id": seq, "base_model": th.BASE}
            response = client.post("/create_sampling_session", json=body)
            assert response.status_code == 200, response.text
            body = prompt_body(sampling_session_id=response.json()["sampling_session_id"])
            assert "sequences" in th.ok(client, "/asample", body)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(use, range(300)))
    assert settles(lambda: threading.active_count() <= baseline + 2), (
        threading.active_count(),
        baseline,
        sorted(t.name for t in threading.enumerate()),
    )
    assert live.app.state.tinker.dispatchers.active() == 0
    # an owner whose dispatcher ended starts it again on its next request
    first = f"{session}:sample:0"
    assert "sequences" in th.ok(http, "/asample", prompt_body(sampling_session_id=first))


def engine_running(live: LiveServer, session_id: str) -> bool:
    row = live.worker.store.get(SessionRow, session_id)
    return row is not None and row.status == SES_RUNNING


def test_heartbeat_expiry_reclaims_models_samplers_and_threads(
    live: LiveServer, http: httpx.Client
) -> None:
    bridge, samplers = live.app.state.tinker, live.app.state.tinker_samplers
    model = th.new_model(http)
    session = model.split(":")[0]
    saved = {"model_id": model, "path": "for-sampling", "sampling_session_seq_id": 0}
    sampler = th.ok(http, "/save_weights_for_sampler", saved)["sampling_session_id"]
    record = bridge.db.get(TinkerSampler, sampler)
    assert record.checkpoint_id in samplers.bound  # the training session publishes it
    # a step and a later save publish newer weights: the first sampler needs a session of its own
    th.ok(http, "/forward_backward", th.fb_body(model))
    th.ok(http, "/optim_step", th.optim_body(model))
    th.ok(http, "/save_weights_for_sampler", {"model_id": model, "path": "later"})
    assert "sequences" in th.ok(http, "/asample", prompt_body(sampling_session_id=sampler))
    engine_sampler = samplers.open[record.checkpoint_id]
    engine_model = bridge.db.get(TinkerModel, model).session_id
    assert engine_running(live, engine_sampler) and engine_running(live, engine_model)
    baseline = threading.active_count()
    bridge.db.update(TinkerSession, session, heartbeat_at=0.0)  # silent for ages
    assert settles(lambda: not engine_running(live, engine_model))
    assert settles(lambda: not engine_running(live, engine_sampler))
    assert record.checkpoint_id not in samplers.open and not samplers.bound
    gone = (engine_model, engine_sampler)  # STOPPING before the queue closes: wait for it
    assert settles(lambda: all(s not in live.worker.sessions for s in gone))
    assert settles(lambda: threading.active_count() <= baseline)
    response = http.post("/session_heartbeat", json={"session_id": session})
    assert response.status_code == 410, response.text


def test_16_clients_sampling_under_eviction(live: LiveServer, http: httpx.Client) -> None:
    model = th.new_model(http)
    count = sampling.MAX_SAMPLER_SESSIONS + 3  # more checkpoints than stay open
    paths = [
        th.ok(http, "/save_weights_for_sampler", {"model_id": model, "path": f"race{i}"})["path"]
        for i in range(count)
    ]

    def client(index: int) -> list[dict[str, Any]]:
        rng = random.Random(index)
        with th.client(live) as http:
            session = th.new_session(http)
            ids = []
            for seq, path in enumerate(paths):
                body = {"session_id": session, "sampling_session_seq_id": seq, "model_path": path}
                ids.append(http.post("/create_sampling_session", json=body).json())
            results = []
            for _ in range(12):
                sampler = rng.choice(ids)["sampling_session_id"]
                results.append(th.wait(http, submit(http, sampler)))
            return results

    def submit(http: httpx.Client, sampler: str) -> str:
        response = http.post("/asample", json=prompt_body(sampling_session_id=sampler))
        assert response.status_code == 200, response.text
        request_id: str = response.json()["request_id"]
        return request_id

    with ThreadPoolExecutor(16) as pool:
        results = [r for rs in pool.map(client, range(16)) for r in rs]
    failed = [r for r in results if "error" in r]
    assert not failed, failed[:3]
    assert len(results) == 16 * 12
    assert len(live.app.state.tinker_samplers.open) <= sampling.MAX_SAMPLER_SESSIONS


class FakeEngine:
    """What `SamplerSessions` reads of the bridge: sessions open, run and stop at once."""

    def __init__(self) -> None:
        self.running: set[str] = set()
        self.on_sessions_ended: list[Callable[[list[str]], None]] = []
        self.worker = SimpleNamespace(store=self)

    def get(self, _: type, session_id: str) -> Any:
        return SimpleNamespace(status=SES_RUNNING) if session_id in self.running else None

    def resource_for(self, _: str) -> str:
        return "mr_fake"

    def open_session(
        self, resource_id: str, spec: dict[str, Any], field: str, who: Any, internal: bool = False
    ) -> str:
        session_id = f"ts_{uuid.uuid4().hex}"
        self.running.add(session_id)
        return session_id

    def stop_session(self, session_id: str) -> None:
        self.running.discard(session_id)


def test_sampler_sessions_under_16_racing_threads() -> None:
    engine = FakeEngine()
    sessions = sampling.SamplerSessions(engine)  # type: ignore[arg-type]
    errors: list[BaseException] = []

    def hammer(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(400):
                checkpoint = f"ckpt-{rng.randrange(8)}"
                sampler = TinkerSampler("s", "", th.BASE, 0.0, checkpoint_id=checkpoint)
                key, session_id = sessions.acquire(sampler)
                assert session_id in engine.running, "handed a closed session"
                time.sleep(0)
                assert session_id in engine.running, "closed while in use"
                sessions.release(key)
        except BaseException as exc:
            errors.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        threads = [threading.Thread(target=hammer, args=(i,)) for i in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors[:3]
    assert len(sessions.open) <= sampling.MAX_SAMPLER_SESSIONS
    assert set(sessions.open.values()) <= engine.running
    assert not any(sessions.in_use.values())


def test_a_sample_that_finds_newer_weights_published_runs_on_its_checkpoint(
    live: LiveServer, http: httpx.Client
) -> None:
    """A binding whose version the training session no longer publishes (a save raced the
    sample) is dropped, and the sample runs again on a session opened from the checkpoint."""
    samplers = live.app.state.tinker_samplers
    model = th.new_model(http)
    saved = {"model_id": model, "path": "raced", "sampling_session_seq_id": 5}
    sampler = th.ok(http, "/save_weights_for_sampler", saved)["sampling_session_id"]
    record = live.app.state.tinker.db.get(TinkerSampler, sampler)
    engine_model = live.app.state.tinker.db.get(TinkerModel, model).session_id
    samplers.bind(record.checkpoint_id, engine_model, 999)  # as if published before a later step
    opened = samplers.opened
    assert "sequences" in th.ok(http, "/asample", prompt_body(sampling_session_id=sampler))
    assert samplers.opened == opened + 1 and record.checkpoint_id in samplers.open
    assert record.checkpoint_id not in samplers.bound
