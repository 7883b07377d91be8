"""`scripts/bench_bodies.py`: what a large request body costs the worker, old parse against new.

For each body size (6, 60, 300 MB of forward-backward JSON: tokens, target tokens, behaviour
logprobs, advantages, mask) and each route (inline where `max_body_bytes`, 64 MiB, allows it;
uploaded as a payload, the SDK's way), a real `trainer serve` process gets the body while
another thread polls `/healthz` every 50 ms. Measured per run:

- the worker's resident-set rise: its `VmHWM` (reset through `/proc/PID/clear_refs` just
  before the run) minus its `VmRSS` after a warm-up body, in a fresh worker per cell; the
  body parser's child (new arm) is reported apart, as its own peak over its idle size;
- the slowest `/healthz` answer during the run;
- the time from the first byte sent to the operation's end. The last target token is outside
  the vocabulary, so the engine fails the operation (naming that token) once it holds the
  whole batch as tensors: the time covers upload, parse, validation, queueing and the
  engine's conversion, not the model's forward (identical in both arms, ~2 min for 60 MB on
  this CPU's tiny model).

Arms: `old` is this worker with a whole-body parse (`json.loads` of the whole
body in the worker: on the event loop inline, in a thread for payloads; the canonical JSON
hash; no `gc.freeze`), patched in by `legacy-serve` below and nowhere else; `new` is the
worker as it ships. Each arm runs `--repeats` times per cell; the table quotes medians.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import hostile
from benchmarks.body_shapes import children, status_kib
from trainer import spawn

ROOT = Path(__file__).resolve().parents[1]
PPO = {"type": "LOSS_TYPE_PPO"}
MB = 1_000_000
VOCAB = 151_936
INLINE_CAP = 64 << 20  # the default max_body_bytes
MARKERS = ("<!-- bench-bodies:start -->", "<!-- bench-bodies:end -->")
HOSTILE_MARKERS = ("<!-- bench-hostile:start -->", "<!-- bench-hostile:end -->")


def wire_body(
    n: int, length: int, seed: int = 0, *, vocab: int = 128, bad_last_target: bool = False
) -> dict[str, Any]:
    """A PPO forward-backward over `n` random samples of `length` tokens, as the SDK sends it:
    token ids, target ids, behaviour logprobs and advantages at full float64 precision, and a
    mask (ones then zeros). `bad_last_target`: the very last target id is out of `vocab`."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(2, vocab, size=(n, length + 1))
    logprobs = -rng.exponential(2.0, size=(n, length))
    advantages = rng.normal(size=(n, length))
    if bad_last_target:
        tokens[-1, -1] = vocab + 1000
    half = length // 2
    mask = [1.0] * half + [0.0] * (length - half)
    samples = []
    for i in range(n):
        inputs = {
            "target_tokens": {"data": tokens[i, 1:].tolist(), "dtype": "int64"},
            "logprobs": {"data": logprobs[i].tolist(), "dtype": "float32"},
            "advantages": {"data": advantages[i].tolist(), "dtype": "float32"},
            "mask": {"data": mask, "dtype": "float32"},
        }
        chunks = [{"encoded_text": {"tokens": tokens[i, :-1].tolist()}}]
        samples.append({"model_input": {"chunks": chunks}, "loss_fn_inputs": inputs})
    return {"loss": PPO, "samples": samples}


class HealthProbe:
    """GET /healthz every 50 ms from another thread; `latencies` (a failed GET counts inf)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import httpx

        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                started = time.perf_counter()
                try:
                    ok = client.get(f"{self.url}/healthz").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.latencies.append(time.perf_counter() - started if ok else float("inf"))
                self._stop.wait(0.05)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join(60)


# -- the old parse, for the `old` arm only ----------------------------------------------------


def _legacy_patch() -> None:
    """A whole-body parse in the worker, swapped into this process."""
    import gc

    from fastapi import Request

    from trainer.api import http as route_helpers
    from trainer.api.rl import routes_ops
    from trainer.serving import payloads
    from trainer.serving.bodies import too_large
    from trainer.serving.errors import bad_request

    gc.freeze = lambda: None  # it froze nothing

    async def json_object(request: Request, limit: int, *, arrays: bool = False) -> Any:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise too_large(limit, declared)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            chunks.append(chunk)
        raw = b"".join(chunks)
        if not raw.strip():
            return {}
        try:
            value = json.loads(raw)  # on the event loop
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise bad_request(f"request body is not valid JSON: {exc}", "body") from None
        return value

    def read_json(self: Any, session_id: str, payload_id: str) -> dict[str, Any]:
        value: dict[str, Any] = json.loads(self.path(session_id, payload_id).read_bytes())
        return value

    def body_hash(kind: str, body: dict[str, Any]) -> str:
        import hashlib

        canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(f"{kind}\n{canonical}".encode()).hexdigest()

    route_helpers.json_object = json_object  # type: ignore[assignment]
    routes_ops.json_object = json_object  # type: ignore[assignment]
    routes_ops.body_hash = body_hash
    payloads.PayloadFiles.read_json = read_json  # type: ignore[method-assign]


# -- one worker, one run ----------------------------------------------------------------------


def _reset_peak(pid: int) -> None:
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/clear_refs").write_text("5")


def _start(arm: str, root: Path, model: Path, token: str) -> spawn.WorkerProcess:
    port = spawn.free_port()
    config = root / f"{arm}.toml"
    config.write_text(
        f'[[model]]\nname = "bench"\nlocation = "{model}"\nmax_batch_size = 65536\n'
        f"max_tokens_per_call = {1 << 26}\n"
    )
    storage = root / f"storage-{arm}"
    args = ["serve", "--host", "127.0.0.1", "--port", str(port), "--storage", str(storage)]
    args += ["--device", "cpu", "--config", str(config), "--log-level", "warning"]
    entry = "legacy-serve" if arm == "old" else "serve"
    env = {**os.environ, "TRAINER_API_TOKEN": token, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "benchmarks.bodies", entry, *args[1:]]
    return spawn.WorkerProcess(cmd, port, root / "worker.log", env, cwd=ROOT)


def _op(http: Any, sid: str, content: bytes) -> dict[str, Any]:
    url = f"/rl/training-sessions/{sid}/operations/forward-backward"
    headers = {"Idempotency-Key": str(uuid.uuid4()), "content-type": "application/json"}
    response = http.post(url, content=content, headers=headers)
    if response.status_code != 200:
        return {"status": f"HTTP {response.status_code}", "error": response.text[:300]}
    op: dict[str, Any] = response.json()
    while not op["status"].endswith(("COMPLETED", "FAILED")):
        time.sleep(0.05)
        op = http.get(f"{url}/{op['id']}").json()
    return op


def _session(http: Any) -> str:
    rid = http.post("/rl/model-resources", json={"base_model": "bench"}).json()["id"]
    while http.get(f"/rl/model-resources/{rid}").json()["status"] != "MODEL_RESOURCES_STATUS_READY":
        time.sleep(0.2)
    body = {"model_resources_id": rid, "lora_config": {"rank": 4, "seed": 0}}
    sid: str = http.post("/rl/training-sessions", json=body).json()["id"]
    while http.get(f"/rl/training-sessions/{sid}").json()["status"] != (
        "TRAINING_SESSION_STATUS_RUNNING"
    ):
        time.sleep(0.2)
    return sid


def _run_once(
    http: Any, pid: int, url: str, sid: str, raw: bytes, route: str, base: int
) -> dict[str, Any]:
    import httpx

    kids = children(pid)
    for p in (pid, *kids):
        _reset_peak(p)
    child_before = sum(status_kib(c, "VmRSS") for c in kids)
    with HealthProbe(url) as probe:
        started = time.perf_counter()
        if route == "inline":
            op = _op(http, sid, raw)
        else:
            grant = http.post(f"/rl/training-sessions/{sid}/payloads/upload-url").json()
            put = httpx.put(grant["upload_url"], content=raw, timeout=600)
            assert put.status_code == 200, put.text
            op = _op(
                http, sid, json.dumps({"loss": PPO, "payload_id": grant["payload_id"]}).encode()
            )
        elapsed = time.perf_counter() - started
    kids = children(pid)
    message = str((op.get("error") or {}).get("message", ""))
    return {
        "ok": op["status"].endswith("FAILED") and "out of range" in message,
        "status": op["status"],
        "rise_mib": (status_kib(pid, "VmHWM") - base) / 1024,
        "parser_mib": (sum(status_kib(c, "VmHWM") for c in kids) - child_before) / 1024
        if kids
        else 0.0,
        "healthz_max_s": max(probe.latencies),
        "seconds": elapsed,
    }


def measure(sizes_mb: Sequence[int], repeats: int, work: Path) -> list[dict[str, Any]]:

    from benchmarks.shapes import ModelShape, save_model

    model = save_model(ModelShape(vocab=VOCAB), work / "model")
    one = len(json.dumps(wire_body(1, 500, vocab=VOCAB)))
    bodies = {}
    for size in sizes_mb:
        n = max(1, round(size * MB / one))
        text = json.dumps(wire_body(n, 500, seed=size, vocab=VOCAB, bad_last_target=True))
        bodies[size] = text.encode()
        del text
        print(f"body {size} MB: {n} samples x 500 tokens, {len(bodies[size]) / MB:.1f} MB")
    rows: list[dict[str, Any]] = []
    for size, raw in bodies.items():
        for route in ("inline", "payload"):
            if route == "inline" and len(raw) > INLINE_CAP:
                continue
            for arm in ("old", "new"):  # interleaved: both arms see the same machine load
                runs = _cell(arm, work / f"{arm}-{size}-{route}", model, raw, route, repeats)
                row = _summary(arm, size, route, runs)
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def _cell(
    arm: str, root: Path, model: Path, raw: bytes, route: str, repeats: int
) -> list[dict[str, Any]]:
    """A fresh worker, warmed up by one small body; then `repeats` runs of `raw`, each RSS
    rise taken against the resident set after the warm-up (freed memory the worker keeps
    counts, as it does for the machine)."""
    import httpx

    root.mkdir(parents=True)
    token = uuid.uuid4().hex
    worker = _start(arm, root, model, token)
    url, pid = worker.url, worker.pid
    try:
        worker.wait_ready(timeout=300, interval=0.2)
        headers = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=f"{url}/v1", headers=headers, timeout=900) as http:
            sid = _session(http)
            _op(http, sid, json.dumps(wire_body(40, 500, seed=1, vocab=VOCAB)).encode())
            time.sleep(0.5)
            base = status_kib(pid, "VmRSS")
            return [_run_once(http, pid, url, sid, raw, route, base) for _ in range(repeats)]
    finally:
        worker.stop(grace=None)
        shutil.rmtree(root, ignore_errors=True)


def _summary(arm: str, size: int, route: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    med = {
        k: statistics.median(r[k] for r in runs) for k in runs[0] if isinstance(runs[0][k], float)
    }
    return {"arm": arm, "size_mb": size, "route": route, "ok": all(r["ok"] for r in runs),
            "runs": len(runs), **med}  # fmt: skip


def render(rows: list[dict[str, Any]], command: str) -> str:
    lines = [
        MARKERS[0],
        f"`{command}` (medians of each cell's runs; machine shared while measured)",
        "",
        "| body | route | arm | worker RSS rise (MiB) | parser process peak (MiB) | "
        "slowest /healthz (s) | to the engine (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['size_mb']} MB | {r['route']} | {r['arm']} | {r['rise_mib']:.0f} | "
            f"{r['parser_mib']:.0f} | {r['healthz_max_s']:.2f} | {r['seconds']:.1f} |"
        )
    lines.append(MARKERS[1])
    return "\n".join(lines)


def write_markdown(table: str, path: Path, markers: tuple[str, str] = MARKERS) -> None:
    text = path.read_text()
    start, end = text.find(markers[0]), text.find(markers[1])
    if start < 0 or end < 0:
        raise RuntimeError(f"{path} has no {markers[0]} ... {markers[1]} markers")
    path.write_text(text[:start] + table + text[end + len(markers[1]) :])


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["legacy-serve"]:  # the old arm's worker
        _legacy_patch()
        from trainer.cli import main as cli_main

        return cli_main(["serve", *argv[1:]])
    if argv[:1] == ["serve"]:
        from trainer.cli import main as cli_main

        return cli_main(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="6,60,300", help="body sizes in MB, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hostile-sizes", default="1,8,60", help="hostile shapes' sizes, MB")
    parser.add_argument("--old-tree", type=Path, help="the old code for the hostile shapes")
    parser.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md alone")
    args = parser.parse_args(argv)
    if args.old_tree is not None:
        _hostile(args)
    if args.sizes:
        _legit(args)
    return 0


def _legit(args: argparse.Namespace) -> None:
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-bodies-") as work:
        rows = measure(sizes, args.repeats, Path(work))
    command = (
        "python scripts/bench_bodies.py"
        + (f" --sizes {args.sizes}" if args.sizes != "6,60,300" else "")
        + (f" --repeats {args.repeats}" if args.repeats != 3 else "")
    )
    table = render(rows, command)
    print(table)
    if not args.no_write:
        write_markdown(table, ROOT / "BENCHMARKS.md")


def _hostile(args: argparse.Namespace) -> None:
    sizes = [float(s) for s in args.hostile_sizes.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-hostile-") as work:
        rows = hostile.measure(sizes, args.old_tree.resolve(), ROOT, Path(work))
    command = (
        f"python scripts/bench_bodies.py --sizes '' --hostile-sizes {args.hostile_sizes} "
        "--old-tree OLD"
    )
    lines = [HOSTILE_MARKERS[0], f"`{command}`", "", *hostile.render(rows), HOSTILE_MARKERS[1]]
    table = "\n".join(lines)
    print(table)
    if not args.no_write:
        write_markdown(table, ROOT / "BENCHMARKS.md", HOSTILE_MARKERS)


if __name__ == "__main__":
    raise SystemExit(main())
