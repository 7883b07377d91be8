"""SIGTERM while the worker computes or writes a checkpoint: it finishes the running operation
(or abandons it cleanly once `shutdown_grace_s` has passed), fails the queued ones, flushes its
catalogue and exits 0 within a bounded time; after a restart the session shows STOPPED and the
operations show what really happened."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.faults.procs import (
    COMPLETED,
    FAILED,
    ce_batch,
    forked_worker,
    new_resource,
    new_session,
    output,
    post_op,
    serve_child,
    terminate,
)

KINDS = {"tiny-qwen": "lora", "tiny-llama": "full"}


def _wait_running(http: httpx.Client, sid: str, kind: str, op_id: str) -> None:
    url = f"/rl/training-sessions/{sid}/operations/{kind}/{op_id}"
    deadline = time.monotonic() + 60
    while http.get(url).json()["status"] != "TRAINING_OPERATION_STATUS_RUNNING":
        assert time.monotonic() < deadline, "the operation never started"
        time.sleep(0.01)


def _start(tmp_path: Path, models: dict[str, Path], grace: float, name: str) -> tuple:
    config = tmp_path / f"{name}.toml"
    config.write_text(f"shutdown_grace_s = {grace}\nop_inline_wait_s = 0\n")
    return (tmp_path / "storage", models, tmp_path / f"{name}.log", "--config", str(config))


@pytest.mark.parametrize(
    ("grace", "samples", "finishes"),
    [(30.0, 12, True), (1.0, 64, False)],
    ids=["finishes-within-grace", "abandoned-after-grace"],
)
def test_sigterm_during_forward_backward(
    tiny_qwen_dir: Path, tmp_path: Path, grace: float, samples: int, finishes: bool
) -> None:
    models = {"tiny-qwen": tiny_qwen_dir}
    storage, _, log, *extra = _start(tmp_path, models, grace, "first")
    with forked_worker(storage, models, log, *extra) as worker, worker.client() as http:
        sid = new_session(http, new_resource(http, "tiny-qwen"), lora_config={"rank": 4})
        running = post_op(http, sid, "forward-backward", ce_batch(1, samples, 512))
        queued = post_op(http, sid, "optim-step", {})
        _wait_running(http, sid, "forward-backward", running["id"])
        code, took = terminate(worker)
    assert code == 0, worker.log()
    assert took < grace + 20, f"exit took {took:.1f}s with a grace of {grace}s"
    assert "worker stopped" in worker.log()

    with forked_worker(storage, models, tmp_path / "second.log") as again, again.client() as http:
        session = http.get(f"/rl/training-sessions/{sid}").json()
        assert session["status"] == "TRAINING_SESSION_STATUS_STOPPED"
        assert session["step"] == 0
        fb = http.get(f"/rl/training-sessions/{sid}/operations/forward-backward/{running['id']}")
        assert fb.json()["status"] == (COMPLETED if finishes else FAILED), fb.json()
        if not finishes:
            assert "shut down" in fb.json()["error"]["message"]
        step = http.get(f"/rl/training-sessions/{sid}/operations/optim-step/{queued['id']}")
        assert step.json()["status"] == FAILED  # queued behind it: never started
        assert step.json()["error"]["code"].endswith("SESSION_NOT_ACTIVE")


@pytest.mark.parametrize("model", ["tiny-qwen", "tiny-llama"])
def test_sigterm_during_checkpoint_writes(
    tiny_qwen_dir: Path, tiny_llama_dir: Path, tmp_path: Path, model: str
) -> None:
    """Several checkpoint writes queued, SIGTERM lands in the first: it completes (listed and
    complete) and the rest fail; nothing partial is listed after the restart."""
    models = {"tiny-qwen": tiny_qwen_dir, "tiny-llama": tiny_llama_dir}
    storage, _, log, *extra = _start(tmp_path, models, 30.0, "first")
    lora = KINDS[model] == "lora"
    with forked_worker(storage, models, log, *extra) as worker, worker.client() as http:
        rid = new_resource(http, model, lora_enabled=lora)
        sid = new_session(http, rid, **({"lora_config": {"rank": 4}} if lora else {}))
        kinds = ["training-checkpoint", "inference-checkpoint"] * 3
        ops = [(kind, post_op(http, sid, kind)["id"]) for kind in kinds]
        code, took = terminate(worker)
    assert code == 0, worker.log()
    assert took < 30

    with forked_worker(storage, models, tmp_path / "second.log") as again, again.client() as http:
        assert not list((storage / "tmp").iterdir())
        session = http.get(f"/rl/training-sessions/{sid}").json()
        assert session["status"] == "TRAINING_SESSION_STATUS_STOPPED"
        listed = {
            c["id"] for c in http.get("/rl/checkpoints", params={"limit": 100}).json()["data"]
        }
        assert listed == {p.name for p in (storage / "checkpoints").iterdir()}
        done = 0
        for kind, op_id in ops:
            op = http.get(f"/rl/training-sessions/{sid}/operations/{kind}/{op_id}").json()
            assert op["status"] in (COMPLETED, FAILED), op
            if op["status"] == COMPLETED:
                done += 1
                assert op["output"]["checkpoint"]["id"] in listed
        assert done == len(listed)
        rid = new_resource(http, model, lora_enabled=lora)
        for ckpt in sorted(listed):  # each one that is listed resumes
            resumed = new_session(http, rid, resume_from_checkpoint_id=ckpt)
            assert http.post(f"/rl/training-sessions/{resumed}/stop").status_code == 200


@pytest.fixture(scope="module")
def model_17m(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 17 M-parameter Qwen3 (vocab 8192, hidden 512, 4 layers): one forward-backward of 8 x
    512 tokens takes many seconds on a CPU core, far past a 1 s grace."""
    from trainer.tiny import TinySpec, build_model

    spec = TinySpec(
        vocab=8192,
        hidden=512,
        intermediate=1536,
        layers=4,
        heads=8,
        kv_heads=4,
        head_dim=64,
        max_positions=1024,
    )
    model = build_model(spec)  # 17 M parameters, seed 0
    assert 15e6 < sum(p.numel() for p in model.parameters()) < 25e6
    out = tmp_path_factory.mktemp("qwen3-17m")
    model.save_pretrained(out)
    return out


def test_sigterm_past_the_grace_exits_0_in_a_real_process(model_17m: Path, tmp_path: Path) -> None:
    """A real `python -m trainer serve` child (not a fork-server child, which ends with
    `os._exit` whatever happens): SIGTERM while a long forward-backward computes, grace 1 s.
    The interpreter used to tear down under the compute thread and die by SIGABRT ("terminate
    called without an active exception"). Now: exit 0, the abandoned op FAILED, the queued op
    FAILED, and what completed before (a step, a checkpoint) intact and resumable."""
    models = {"m": model_17m}
    storage, _, _, *extra = _start(tmp_path, models, 1.0, "first")
    with serve_child(storage, models, *extra, log_path=tmp_path / "first.log") as worker:
        with worker.client() as http:
            sid = new_session(http, new_resource(http, "m"), lora_config={"rank": 4, "seed": 0})
            assert output(http, sid, "forward-backward", ce_batch(0, 1, 16, vocab=8192))
            assert output(http, sid, "optim-step", {})["step"] == 1
            ckpt = output(http, sid, "training-checkpoint")["checkpoint"]["id"]
            running = post_op(http, sid, "forward-backward", ce_batch(1, 8, 512, vocab=8192))
            queued = post_op(http, sid, "optim-step", {})
            _wait_running(http, sid, "forward-backward", running["id"])
            time.sleep(0.3)  # well inside the computation
        code, took = worker.terminate(timeout=60)
    log = worker.log()
    assert code == 0, log
    assert took < 1.0 + 20, f"exit took {took:.1f}s with a grace of 1s"
    assert "abandoning op forward-backward" in log and "worker stopped" in log, log
    assert "terminate called" not in log and "Segmentation" not in log, log

    with (
        serve_child(storage, models, log_path=tmp_path / "second.log") as again,
        again.client() as http,
    ):
        session = http.get(f"/rl/training-sessions/{sid}").json()
        assert session["status"] == "TRAINING_SESSION_STATUS_STOPPED"
        assert session["step"] == 1
        fb = http.get(f"/rl/training-sessions/{sid}/operations/forward-backward/{running['id']}")
        assert fb.json()["status"] == FAILED, fb.json()  # it was still computing at the grace
        assert "shut down while it ran" in fb.json()["error"]["message"]
        step = http.get(f"/rl/training-sessions/{sid}/operations/optim-step/{queued['id']}")
        assert step.json()["status"] == FAILED
        assert step.json()["error"]["code"].endswith("SESSION_NOT_ACTIVE")
        listed = [c["id"] for c in http.get("/rl/checkpoints").json()["data"]]
        assert listed == [ckpt]
        resumed = new_session(http, new_resource(http, "m"), resume_from_checkpoint_id=ckpt)
        assert http.get(f"/rl/training-sessions/{resumed}").json()["step"] == 1
