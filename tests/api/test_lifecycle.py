"""Resources and sessions lifecycle: concurrent loads, caps, idle threads, the
effective LoRA config of a resumed session, optimizer_config fields, context length, and how
long a resource create takes through the SDK.

Everything runs against a live worker (real engine, tiny models) or, for loading races, a fresh
interpreter; weights are compared with a plain `transformers` load of the same directory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from api_helpers import ce_sample, model_input
from conftest import TOKEN, LiveServer, serve_in_thread, wait_status

from tests.faults.procs import TERMINAL, new_resource, run_op
from trainer.serving.queues import Job, SessionQueue

REPO = Path(__file__).resolve().parents[2]
READY = "MODEL_RESOURCES_STATUS_READY"
CE = {"type": "LOSS_TYPE_CROSS_ENTROPY"}


def create_resource(http: httpx.Client, base_model: str, **extra: Any) -> httpx.Response:
    return http.post("/rl/model-resources", json={"base_model": base_model, **extra})


def create_session(http: httpx.Client, rid: str, **extra: Any) -> httpx.Response:
    return http.post("/rl/training-sessions", json={"model_resources_id": rid, **extra})


def running_session(http: httpx.Client, rid: str, **extra: Any) -> str:
    response = create_session(http, rid, **extra)
    assert response.status_code == 200, response.text
    assert response.json()["status"] == "TRAINING_SESSION_STATUS_RUNNING", response.text
    sid: str = response.json()["id"]
    return sid


def wait_until(predicate: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def at_once(calls: list[Any]) -> list[Any]:
    """Run the calls in threads released together by a barrier."""
    barrier = threading.Barrier(len(calls))

    def run(call: Any) -> Any:
        barrier.wait()
        return call()

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(run, calls))


# -- item 1: concurrent loads ------------------------------------------------------------------

FRESH_LOADS = r"""
import json, sys, threading
import torch
from trainer.compute.model import load_base_model
from trainer.contract.specs import ModelEntry

jobs = json.loads(sys.argv[1])
linspace, dtype = torch.linspace, torch.get_default_dtype()
entries = [ModelEntry(name=f"m{i}", location=d, dtype=t) for i, (d, t) in enumerate(jobs)]
barrier = threading.Barrier(len(entries))
models, errors = [None] * len(entries), []

def load(i):
    barrier.wait()
    try:
        models[i] = load_base_model(entries[i], torch.device("cpu"))[0]
    except Exception as exc:
        errors.append(f"{type(exc).__name__}: {exc}"[:200])

threads = [threading.Thread(target=load, args=(i,)) for i in range(len(entries))]
for t in threads: t.start()
for t in threads: t.join()

from transformers import AutoModelForCausalLM, PreTrainedModel
mismatched = []
for (location, dt), model in zip(jobs, models):
    if model is None:
        continue
    plain = AutoModelForCausalLM.from_pretrained(location, dtype=getattr(torch, dt)).state_dict()
    mine = model.state_dict()
    if set(plain) != set(mine) or any(not torch.equal(plain[k], mine[k]) for k in plain):
        mismatched.append(location)
print(json.dumps({
    "errors": errors,
    "mismatched": mismatched,
    "default_dtype_kept": torch.get_default_dtype() == dtype,
    "linspace_kept": torch.linspace is linspace,
    "tie_weights_kept": PreTrainedModel.tie_weights.__qualname__ == "PreTrainedModel.tie_weights",
}))
"""


def test_concurrent_loads_in_a_fresh_interpreter(tiny_qwen_dir: Path, tiny_llama_dir: Path) -> None:
    """8 loads at once in a fresh process (transformers not imported yet: its lazy imports race),
    tied and untied, fp32 and bf16: all load, each equals a plain load, no global stays patched."""
    jobs = [
        (str(d), t)
        for d in (tiny_qwen_dir, tiny_llama_dir)
        for t in ("float32", "bfloat16", "float32", "bfloat16")
    ]
    done = subprocess.run(
        [sys.executable, "-c", FRESH_LOADS, json.dumps(jobs)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {
        "errors": [],
        "mismatched": [],
        "default_dtype_kept": True,
        "linspace_kept": True,
        "tie_weights_kept": True,
    }


def test_eight_concurrent_creates_are_ready_with_the_right_weights(
    tiny_qwen_dir: Path, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """8 POSTs at once on a fresh worker (same model and different models, fp32 and bf16): all
    READY, each resource's weights equal a plain transformers load of its directory."""
    from transformers import AutoModelForCausalLM, PreTrainedModel

    model = [
        {"name": "tiny-qwen", "location": str(tiny_qwen_dir)},
        {"name": "tiny-llama", "location": str(tiny_llama_dir)},
        {"name": "tiny-qwen-bf16", "location": str(tiny_qwen_dir), "dtype": "bfloat16"},
    ]
    names = ["tiny-qwen", "tiny-llama", "tiny-qwen-bf16", "tiny-qwen"] * 2
    with serve_in_thread(tmp_path / "storage", {}, model=model) as live, live.client() as http:
        responses = at_once([lambda n=n: create_resource(http, n) for n in names])
        assert [r.status_code for r in responses] == [200] * 8, [r.text for r in responses]
        rids = [r.json()["id"] for r in responses]
        for rid in rids:
            body = wait_status(http, f"/rl/model-resources/{rid}", READY)
            assert body["status"] == READY, body
        plain = {
            entry["name"]: AutoModelForCausalLM.from_pretrained(
                entry["location"], dtype=getattr(torch, entry.get("dtype", "float32"))
            ).state_dict()
            for entry in model
        }
        for name, rid in zip(names, rids):
            engine = live.worker.resources.live[rid].engine
            mine = engine.model.state_dict()
            assert set(mine) == set(plain[name])
            for key, value in plain[name].items():
                assert torch.equal(mine[key], value), (name, key)
    # nothing transformers swaps while it loads stays swapped
    assert PreTrainedModel.tie_weights.__qualname__ == "PreTrainedModel.tie_weights"
    assert torch.get_default_dtype() == torch.float32


# -- item 7: caps and threads ------------------------------------------------------------------


def test_resource_cap(tiny_qwen_dir: Path, tmp_path: Path) -> None:
    """Four creates at once under max_resources 2: two READY, two 400 naming the cap, no rows."""
    model = [{"name": "tiny-qwen", "location": str(tiny_qwen_dir)}]
    with (
        serve_in_thread(tmp_path / "s", {}, model=model, max_resources=2) as live,
        live.client() as http,
    ):
        responses = at_once([lambda: create_resource(http, "tiny-qwen") for _ in range(4)])
        ok = [r for r in responses if r.status_code == 200]
        refused = [r for r in responses if r.status_code != 200]
        assert len(ok) == 2 and all(r.json()["status"] == READY for r in ok)
        assert len(refused) == 2
        for response in refused:
            assert response.status_code == 400
            error = response.json()["error"]
            assert error["code"] == "resource_at_capacity" and error["param"] == "base_model"
            assert "max_resources 2" in error["message"]
            assert response.headers["x-should-retry"] == "false"
        assert len(http.get("/rl/model-resources").json()["data"]) == 2
        stopped = http.post(f"/rl/model-resources/{ok[0].json()['id']}/stop").json()
        assert stopped["status"] == "MODEL_RESOURCES_STATUS_STOPPED"
        assert create_resource(http, "tiny-qwen").json()["status"] == READY


def _ops_threads() -> int:
    return sum(t.name.startswith(("ops-", "open-")) for t in threading.enumerate())


def test_session_cap_and_no_thread_per_idle_session(tiny_qwen_dir: Path, tmp_path: Path) -> None:
    """Idle sessions hold no thread (a busy one holds one while it works); the 7th session
    under max_sessions_per_resource 6 is a 400 naming the field, leaving no row."""
    model = [{"name": "tiny-qwen", "location": str(tiny_qwen_dir)}]
    with (
        serve_in_thread(tmp_path / "s", {}, model=model, max_sessions_per_resource=6) as live,
        live.client() as http,
    ):
        rid = new_resource(http, "tiny-qwen")
        sids = [running_session(http, rid, lora_config={"rank": 2}) for _ in range(6)]
        assert wait_until(lambda: _ops_threads() == 0), threading.enumerate()
        total_before = threading.active_count()
        # every session works (a thread each while busy), then all go idle again
        for sid in sids:
            body = {"loss": CE, "samples": [ce_sample([3, 4, 5, 6])], "forward_only": True}
            assert run_op(http, sid, "forward-backward", body)["status"] == TERMINAL[0]
        assert wait_until(lambda: _ops_threads() == 0), threading.enumerate()
        assert threading.active_count() <= total_before + 2  # (the HTTP server's own pool)

        refused = create_session(http, rid)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "model_resources_id" and error["code"] == "resource_at_capacity"
        assert "max_sessions_per_resource 6" in error["message"]

        # two slots free up; six creates at once take exactly those two
        for sid in sids[:2]:
            stopped = http.post(f"/rl/training-sessions/{sid}/stop").json()
            assert stopped["status"] == "TRAINING_SESSION_STATUS_STOPPED"
        responses = at_once([lambda: create_session(http, rid) for _ in range(6)])
        assert sorted(r.status_code for r in responses) == [200, 200, 400, 400, 400, 400]
        listed = http.get("/rl/training-sessions", params={"limit": 100}).json()["data"]
        assert len(listed) == 8  # the refused creates left nothing behind


def test_session_queue_runs_in_order_with_a_thread_only_while_busy() -> None:
    """FIFO, one job at a time, no thread when idle, `close` returns the queued jobs and
    `on_closed` runs once after the running job, `join` waits for it."""
    order: list[str] = []
    closed: list[int] = []
    active = {"now": 0, "max": 0}
    gate = threading.Event()

    def finish(job: Job) -> None:
        active["now"] += 1
        active["max"] = max(active["max"], active["now"])
        job.call()
        order.append(job.op_id)
        active["now"] -= 1

    name = f"q{uuid.uuid4().hex[:8]}"
    queue = SessionQueue(name, finish, lambda: closed.append(len(order)))
    threads = lambda: [t for t in threading.enumerate() if t.name == f"ops-{name}"]  # noqa: E731
    assert threads() == []  # a new queue holds no thread
    jobs = [Job(f"op{i}", "x", lambda: (time.sleep(0.001), {})[1]) for i in range(200)]
    for job in jobs:
        assert queue.submit(job)
    for job in jobs:
        job.done.result(timeout=30)
    assert order == [job.op_id for job in jobs] and active["max"] == 1
    assert wait_until(lambda: threads() == [])  # idle again: no thread
    assert not queue.busy and queue.running is None

    blocked = Job("blocked", "x", lambda: (gate.wait(30), {})[1])
    queued = [Job(f"late{i}", "x", lambda: {}) for i in range(3)]
    for job in (blocked, *queued):
        assert queue.submit(job)
    assert wait_until(lambda: queue.running is blocked)
    assert queue.close() == queued  # not started: returned for the caller to fail
    assert not queue.submit(Job("after", "x", lambda: {}))
    assert not queue.join(0.05) and closed == []  # the running job is not done yet
    gate.set()
    assert queue.join(5) and closed == [201]  # on_closed once, after the running job
    assert queue.close() == [] and closed == [201]

    idle = SessionQueue(f"{name}i", finish, lambda: closed.append(-1))
    assert idle.close() == [] and idle.join(5) and closed[-1] == -1  # closing an idle queue


# -- item 12: the effective LoRA config of a resumed session -----------------------------------


def _lora(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    config: dict[str, Any] = response.json()["lora_config"]
    return {k: config[k] for k in ("rank", "alpha", "dropout", "train_unembed")}


def test_resumed_session_reports_its_checkpoint_lora_config(
    tiny_qwen_dir: Path, tmp_path: Path
) -> None:
    storage, roots = tmp_path / "storage", tmp_path / "roots"
    entry = {"name": "tiny-qwen", "location": str(tiny_qwen_dir)}
    trained = {"rank": 4, "alpha": 8, "dropout": 0.0, "train_unembed": False}
    served = {"model": [entry], "resume_roots": [roots]}
    with serve_in_thread(storage, {}, **served) as live, live.client() as http:
        rid = new_resource(http, "tiny-qwen")
        sid = running_session(http, rid, lora_config={**trained, "seed": 1})
        training = run_op(http, sid, "training-checkpoint", {})["output"]["checkpoint"]["id"]
        inference = run_op(http, sid, "inference-checkpoint", {})["output"]["checkpoint"]["id"]
        record = live.worker.checkpoints.get(inference)
        assert record is not None
        adapter_dir = roots / "adapter"  # a copy: the storage's own is named by id only
        shutil.copytree(record.path / "adapter", adapter_dir)
        cases = [
            {"resume_from_checkpoint_id": training},
            {"resume_from_checkpoint_id": training, "lora_config": {"rank": 16, "alpha": 3}},
            {"resume_from_checkpoint_id": training, "load_optimizer": False},
            {"resume_from_checkpoint_id": inference},
            {"resume_from_hf_checkpoint": str(adapter_dir), "lora_config": {"rank": 8}},
        ]
        for body in cases:
            created = create_session(http, rid, **body)
            assert _lora(created) == trained, body
            resumed = created.json()["id"]
            assert _lora(http.get(f"/rl/training-sessions/{resumed}")) == trained, body
            # the adapter it trains is that rank too: its export says so
            out = run_op(http, resumed, "inference-checkpoint", {})["output"]["checkpoint"]["id"]
            assert http.get(f"/rl/checkpoints/{out}").json()["lora_rank"] == 4, body
            http.post(f"/rl/training-sessions/{resumed}/stop")

    # the same storage under a lower max_lora_rank: the checkpoint's rank is what is checked
    with (
        serve_in_thread(
            storage, {}, model=[{**entry, "max_lora_rank": 2}], resume_roots=[roots]
        ) as live,
        live.client() as http,
    ):
        rid = new_resource(http, "tiny-qwen")
        before = len(http.get("/rl/training-sessions", params={"limit": 100}).json()["data"])
        for field, value in (
            ("resume_from_checkpoint_id", training),
            ("resume_from_hf_checkpoint", str(adapter_dir)),
        ):
            refused = create_session(http, rid, **{field: value, "lora_config": {"rank": 1}})
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["param"] == field and "max_lora_rank 2" in error["message"], error
        after = http.get("/rl/training-sessions", params={"limit": 100}).json()["data"]
        assert len(after) == before  # refused before anything was recorded


# -- items 13, 14, 15 on one worker ------------------------------------------------------------


@pytest.fixture(scope="module")
def limits_server(
    tiny_qwen_dir: Path, tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    model = [
        {"name": "tiny-qwen", "location": str(tiny_qwen_dir)},  # max_seq_length unset
        {"name": "tiny-qwen-256", "location": str(tiny_qwen_dir), "max_seq_length": 256},
        {"name": "tiny-llama-4096", "location": str(tiny_llama_dir), "max_seq_length": 4096},
    ]
    with serve_in_thread(tmp_path_factory.mktemp("limits"), {}, model=model) as live:
        yield live


def test_unknown_optimizer_config_fields_are_refused(limits_server: LiveServer) -> None:
    with limits_server.client() as http:
        before = len(http.get("/rl/model-resources").json()["data"])
        bad = {"adam": {"learning_rate": 0.0123, "grad_clip_norm": 0.5}}
        refused = create_resource(http, "tiny-qwen", optimizer_config=bad)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "optimizer_config"
        for name in ("optimizer_config.adam.learning_rate", "optimizer_config.adam.grad_clip_norm"):
            assert name in error["message"], error
        muon = {"muon": {"scaling_strategy": "MUON_SCALING_STRATEGY_ORIGINAL", "bogus": 1}}
        assert create_resource(http, "tiny-qwen", optimizer_config=muon).status_code == 400
        assert create_resource(http, "tiny-qwen", optimizer_config={"adam": 1}).status_code == 400
        assert len(http.get("/rl/model-resources").json()["data"]) == before
        for fine in ({"adam": {}}, {"adam": None}, {}):
            created = create_resource(http, "tiny-qwen", optimizer_config=fine)
            assert created.status_code == 200, (fine, created.text)
            assert created.json()["optimizer_config"] == {"adam": {}}
            http.post(f"/rl/model-resources/{created.json()['id']}/stop")


def test_context_length_is_the_models(limits_server: LiveServer) -> None:
    """supported-models advertises max_position_embeddings (512) or a smaller configured limit,
    and sampling or training past it is a 400 naming the field; at the limit it runs."""
    with limits_server.client() as http:
        served = {m["base_model"]: m for m in http.get("/rl/supported-models").json()["data"]}
        expected = {"tiny-qwen": 512, "tiny-qwen-256": 256, "tiny-llama-4096": 512}
        for name, limit in expected.items():
            compute = served[name]["compute_configs"][0]
            assert compute["generator_config"]["context_length"] == limit, name
            assert compute["trainer_config"]["lora"]["max_seq_length"] == limit, name
            assert compute["trainer_config"]["full"]["max_seq_length"] == limit, name

        rid = new_resource(http, "tiny-llama-4096")
        sid = running_session(http, rid, lora_config={"rank": 2})
        url = f"/rl/training-sessions/{sid}/operations"
        key = {"Idempotency-Key": str(uuid.uuid4())}

        def sample(prompt: int, max_tokens: int) -> httpx.Response:
            body = {
                "model_inputs": [model_input([5] * prompt)],
                "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0},
            }
            return http.post(
                f"{url}/sample", json=body, headers={"Idempotency-Key": str(uuid.uuid4())}
            )

        for prompt, max_tokens, field in (
            (1500, 10, "model_inputs[0]"),
            (400, 200, "model_inputs[0]"),
            (10, 600, "sampling_params.max_tokens"),
        ):
            refused = sample(prompt, max_tokens)
            assert refused.status_code == 400, (prompt, max_tokens, refused.text)
            assert refused.json()["error"]["param"] == field, refused.json()
            assert "512" in refused.json()["error"]["message"]
        too_long = {"loss": CE, "samples": [ce_sample(list(range(3, 100)) * 6 + [7])]}  # 582
        refused = http.post(f"{url}/forward-backward", json=too_long, headers=key)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "samples[0].model_input"

        at_limit = sample(508, 4)
        assert at_limit.status_code == 200, at_limit.text
        op = at_limit.json()
        while op["status"] not in TERMINAL:
            time.sleep(0.02)
            op = http.get(f"{url}/sample/{op['id']}").json()
        assert op["status"] == TERMINAL[0], op
        fits = {
            "loss": CE,
            "samples": [ce_sample(([3, 4, 5, 6] * 200)[:513])],
            "forward_only": True,
        }
        assert run_op(http, sid, "forward-backward", fits)["status"] == TERMINAL[0]
        http.post(f"/rl/model-resources/{rid}/stop", params={"force": "true"})


def test_sdk_create_returns_once_loaded(limits_server: LiveServer) -> None:
    """ModelResourcesClient.create with its default 10 s poll interval returns within the load
    time plus about a second: the POST itself answers READY once the model has loaded."""
    from together.post_training import ModelResourcesClient

    started = time.monotonic()
    resource = ModelResourcesClient.create(
        api_key=TOKEN, base_url=limits_server.api, base_model="tiny-qwen"
    )
    elapsed = time.monotonic() - started
    try:
        assert resource.retrieve().status == READY
        assert elapsed < 8.0, elapsed  # loads in under a second; before: >= one 10 s poll
    finally:
        resource.stop(force=True)
