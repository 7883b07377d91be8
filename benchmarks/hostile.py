"""Part of `scripts/bench_bodies.py`: the worst body shapes on both faces, old code against new.

For each face and shape of `benchmarks.body_shapes` at each size, a real `trainer serve`
process (one per arm, restarted after a run it did not survive) gets the body while another
thread polls `/healthz` every 50 ms. Measured per run: the rise of the summed peak resident
sets of the worker and its children (the body parser's child) over their resident sets just
before, the slowest `/healthz`, the answer and the time to it. `old` runs the code of another
tree (`--old-tree`, e.g. `git archive` of the branch's base commit), `new` this one. A run
stops at `TIMEOUT_S` or when the tree's resident sets pass `MEMORY_CAP_MIB` (the worker is
then killed); such cells read `> limit`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.body_shapes import (
    FACES,
    children,
    hostile_bodies,
    peak_kib,
    reset_peaks,
    status_kib,
)
from trainer import spawn

TIMEOUT_S = 60.0
MEMORY_CAP_MIB = 4096
PROTOBUF = "application/x-protobuf"


class _Worker:
    def __init__(self, tree: Path, root: Path, model: Path, token: str) -> None:
        self.tree, self.root, self.model, self.token = tree, root, model, token
        self.proc: spawn.WorkerProcess | None = None
        self.sid = ""

    def start(self) -> spawn.WorkerProcess:
        if self.proc is not None and self.proc.process.poll() is None:
            return self.proc
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir(parents=True)
        config = self.root / "worker.toml"
        config.write_text(f'[[model]]\nname = "bench"\nlocation = "{self.model}"\n')
        port = spawn.free_port()
        args = ["serve", "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"]
        args += ["--storage", str(self.root / "storage"), "--config", str(config)]
        env = {**os.environ, "TRAINER_API_TOKEN": self.token, "HF_HUB_OFFLINE": "1"}
        env["PYTHONPATH"] = str(self.tree)
        cmd = [sys.executable, "-m", "trainer", *args, "--log-level", "warning"]
        self.proc = spawn.WorkerProcess(cmd, port, self.root / "worker.log", env, cwd=self.tree)
        self.proc.wait_ready(timeout=300, interval=0.2)
        self.sid = _session(self.proc.url, self.token)
        return self.proc

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop(grace=None)
            self.proc = None


def _session(url: str, token: str) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=f"{url}/v1", headers=headers, timeout=120) as http:
        rid = http.post("/rl/model-resources", json={"base_model": "bench"}).json()["id"]
        while http.get(f"/rl/model-resources/{rid}").json()["status"] != (
            "MODEL_RESOURCES_STATUS_READY"
        ):
            time.sleep(0.2)
        body = {"model_resources_id": rid, "lora_config": {"rank": 4}}
        sid: str = http.post("/rl/training-sessions", json=body).json()["id"]
        return sid


def _post(worker: _Worker, face: str, raw: bytes, out: dict[str, Any]) -> None:
    import httpx

    assert worker.proc is not None
    if face == "rl":
        path = f"/v1/rl/training-sessions/{worker.sid}/operations/forward-backward"
    else:
        path = "/api/v1/forward_backward"
    headers = {
        "Authorization": f"Bearer {worker.token}",
        "content-type": PROTOBUF if face == "tinker-proto" else "application/json",
        "Idempotency-Key": str(uuid.uuid4()),
    }
    try:
        response = httpx.post(
            worker.proc.url + path, content=raw, headers=headers, timeout=TIMEOUT_S
        )
        error = response.json().get("error") if response.status_code >= 400 else None
        out["answer"] = f"{response.status_code} {(error or {}).get('param', '')}".strip()
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        out["answer"] = type(exc).__name__


def run_once(worker: _Worker, face: str, raw: bytes) -> dict[str, Any]:
    """One body against the worker; the worker is stopped if it did not survive the limits."""
    from benchmarks.bodies import HealthProbe

    proc = worker.start()
    time.sleep(0.3)
    pids, before = reset_peaks(proc.pid)
    out: dict[str, Any] = {}
    started = time.perf_counter()
    thread = threading.Thread(target=_post, args=(worker, face, raw, out), daemon=True)
    with HealthProbe(proc.url) as probe:
        thread.start()
        capped = False
        while thread.is_alive():
            thread.join(0.1)
            tree = [proc.pid, *children(proc.pid)]
            if sum(status_kib(p, "VmRSS") for p in tree) - before > MEMORY_CAP_MIB * 1024:
                capped = True
                break
        seconds = time.perf_counter() - started
        rise = (peak_kib(pids) - before) / 1024
        deadline = time.monotonic() + 2
        while not probe.latencies and time.monotonic() < deadline:  # one answer at least
            time.sleep(0.01)
    if capped or "answer" not in out or not out["answer"].startswith("400"):
        worker.stop()
    return {
        "answer": "memory cap" if capped else out.get("answer", "timeout"),
        "rise_mib": rise,
        "capped": capped,
        "healthz_max_s": max(probe.latencies, default=float("inf")),
        "seconds": seconds,
    }


def measure(
    sizes_mb: list[float], old_tree: Path, new_tree: Path, work: Path
) -> list[dict[str, Any]]:
    """Every face x shape x size, old and new arm interleaved."""
    from benchmarks.shapes import ModelShape, save_model

    model = save_model(ModelShape(), work / "model")
    token = uuid.uuid4().hex
    arms = {
        arm: _Worker(tree, work / f"hostile-{arm}", model, token)
        for arm, tree in (("old", old_tree), ("new", new_tree))
    }
    rows = []
    try:
        for face in FACES:
            warm = hostile_bodies(face, 1.5)
            for shape in warm:
                for size in sizes_mb:
                    raw = hostile_bodies(face, size)[shape]
                    for arm, worker in arms.items():
                        if arm == "new":  # starts the body parser's child
                            run_once(worker, face, warm[shape])
                        row = {"face": face, "shape": shape, "size_mb": size, "arm": arm}
                        row |= run_once(worker, face, raw)
                        print(json.dumps(row), flush=True)
                        rows.append(row)
    finally:
        for worker in arms.values():
            worker.stop()
    return rows


def render(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| face | shape | body | arm | answer | RSS rise, worker + children (MiB) | "
        "slowest /healthz (s) | time (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rise = f"> {MEMORY_CAP_MIB}" if r["capped"] else f"{r['rise_mib']:.0f}"
        health = r["healthz_max_s"]
        health_text = f"{health:.2f}" if health != float("inf") else "failed"
        took = f"> {TIMEOUT_S:.0f}" if r["answer"] == "ReadTimeout" else f"{r['seconds']:.1f}"
        lines.append(
            f"| {r['face']} | {r['shape']} | {r['size_mb']:g} MB | {r['arm']} | {r['answer']} "
            f"| {rise} | {health_text} | {took} |"
        )
    return lines
