"""Row 6: training checkpoint writes against a raw sequential write of the same bytes.

Three arms run interleaved, one of each per repetition, on the same disk in the same process:

- `ours`: `save_training_checkpoint` of a full-weights session with AdamW state
  (`save_tensors` from the live tensors under the session lock, no copy-out; fsync + sha256
  of each file started as it closes and finished after the lock is released; manifest,
  rename, catalogue);
- `baseline`: the path before that change, through the same store: a clone of every tensor
  under the lock, then
  `safetensors.torch.save_file` for each file, then fsync ∥ sha256 of all files once the writer
  returns;
- `raw`: one `write` + `fsync` of the same byte count.

Then a few more untimed repetitions of `ours` and `baseline` record where the time goes
(`extra.phases`): copy-out (none in `ours`), writing the files, waiting for fsync + sha256,
and the rest (directory fsyncs, manifest, rename, SQLite insert).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import safetensors.torch

from benchmarks.engine_setup import ce_samples, make_resource, make_session
from benchmarks.harness import Measurement, measure
from benchmarks.shapes import rl_batch, shape_from
from trainer.checkpoint import layout
from trainer.checkpoint.files import Sealer
from trainer.checkpoint.store import TRAINING, CheckpointStore, write_json
from trainer.compute import optim
from trainer.contract.specs import AdamParams, LossConfig


def raw_write(path: Path, nbytes: int, block: int = 16 << 20) -> float:
    """Sequential write of `nbytes` with one fsync, like a single large file; seconds."""
    buf = memoryview(os.urandom(block))
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as fh:
        left = nbytes
        while left > 0:
            left -= fh.write(buf[: min(block, left)])
        os.fsync(fh.fileno())
    elapsed = time.perf_counter() - start
    path.unlink()
    return elapsed


def baseline_save(session: Any) -> None:
    """The training-checkpoint write before `save_tensors`: same copy-out, then safetensors'
    `save_file`, then every file sealed after the writer returns (the store seals what the
    writer did not hand over)."""
    with session.operation_scope():
        weights = {n: p.detach().to("cpu").clone() for n, p in session.policy.trainable.items()}
        optimizer = optim.state_tensors(session.optimizer, session.policy.trainable)
        rng = {"cpu": session.cpu_rng.clone()}
        state = layout.state_json(session)

    def writer(out: Path) -> None:
        safetensors.torch.save_file(weights, str(out / "weights.safetensors"))
        safetensors.torch.save_file(optimizer, str(out / "optimizer.safetensors"))
        safetensors.torch.save_file(rng, str(out / "rng.safetensors"))
        write_json(out / "state.json", state)

    session._store(TRAINING, writer)


@contextmanager
def _timed(owner: Any, name: str, totals: dict[str, float], key: str) -> Iterator[None]:
    """Add the wall time of every call of `owner.name` to `totals[key]` inside the block."""
    original = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            totals[key] = totals.get(key, 0.0) + time.perf_counter() - start

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _phases(save: Callable[[], None], store: Any, reps: int) -> dict[str, float]:
    """Median seconds per phase of `save` over `reps` untimed runs."""
    runs: list[dict[str, float]] = []
    for _ in range(reps):
        t: dict[str, float] = {}
        with (
            _timed(layout, "save_tensors", t, "write files"),
            _timed(safetensors.torch, "save_file", t, "write files"),
            _timed(Sealer, "finish", t, "wait fsync ∥ sha256"),
            _timed(CheckpointStore, "_insert", t, "SQLite insert"),
            _timed(store, "write", t, "store"),
        ):
            start = time.perf_counter()
            save()
            total = time.perf_counter() - start
        _clear(store.dir)
        t["copy-out under the lock"] = total - t.pop("store")
        t["dir fsyncs, manifest, rename"] = total - sum(t.values())
        t["total"] = total
        runs.append(t)
    return {k: statistics.median(r.get(k, 0.0) for r in runs) for k in runs[0]}


def _clear(directory: Path) -> None:
    for path in directory.iterdir():
        shutil.rmtree(path)


def checkpoint_arm(params: dict[str, Any]) -> Measurement:
    """`times`: ours; `extra.baseline_times`, `extra.raw_times`: the other two arms."""
    storage = Path(params["storage"])
    resource = make_resource(params["model_dir"], lora=False, storage=str(storage))
    session = make_session(resource)
    batch = rl_batch(0, 1, (1, 1), (8, 8), shape_from(params).vocab)
    session.forward_backward(LossConfig(type="LOSS_TYPE_CROSS_ENTROPY"), ce_samples(batch))
    session.optim_step(AdamParams())
    store = resource.store
    sizes: list[int] = []
    baseline_times: list[float] = []
    raw_times: list[float] = []

    def save() -> None:
        record = session.save_training_checkpoint()
        sizes.append(sum(f.stat().st_size for f in record.path.rglob("*") if f.is_file()))

    def others() -> None:
        _clear(store.dir)
        start = time.perf_counter()
        baseline_save(session)
        baseline_times.append(time.perf_counter() - start)
        _clear(store.dir)
        raw_times.append(raw_write(storage / "raw.bin", sizes[-1]))

    result = measure(save, reps=params["reps"], warmup=1, after=others)
    profile_reps = max(1, min(3, params["reps"]))
    phases = {
        "ours": _phases(lambda: session.save_training_checkpoint(), store, profile_reps),
        "baseline": _phases(lambda: baseline_save(session), store, profile_reps),
    }
    blob = os.urandom(64 << 20)
    start = time.perf_counter()
    hashlib.sha256(blob).digest()
    sha_mb_s = 64 / (time.perf_counter() - start)
    result.extra = {
        "bytes": sizes[-1],
        "raw_times": raw_times,
        "baseline_times": baseline_times,
        "sha256_mb_s": sha_mb_s,
        "phases": phases,
    }
    return result
