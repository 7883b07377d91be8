"""Hostile request bodies on both faces cost memory in proportion to their size.

Against a real `trainer serve` process (its body parser's child counted too), each worst shape
of a Tinker `forward_backward` (protobuf empty datums, protobuf empty `loss_fn_inputs`
entries, JSON empty datums, one JSON datum of millions of tokens) and of an RL
`forward-backward` (`{}` samples, one sample of millions of tokens) at 8-16 MB is a 400
naming the field, the resident sets rise by at most `3 x body + 64 MiB`, and `/healthz`
answers within 1.5 s while the body is read and refused.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from benchmarks.bodies import HealthProbe
from benchmarks.body_shapes import hostile_bodies, peak_kib, reset_peaks
from tests.faults.procs import TOKEN, serve_child
from trainer.api.tinker import proto

MIB = 1 << 20


@pytest.fixture(scope="module")
def worker(tiny_qwen_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    root = tmp_path_factory.mktemp("hostile-bodies")
    config = root / "worker.toml"
    config.write_text(
        f'max_body_bytes = {64 * MIB}\n\n[[model]]\nname = "tiny-qwen"\n'
        f'location = "{tiny_qwen_dir}"\n'
    )
    with serve_child(root / "storage", {}, "--config", str(config)) as child:
        yield child


def _post(url: str, path: str, raw: bytes, content_type: str) -> httpx.Response:
    headers = {
        "Authorization": f"Bearer {TOKEN}",
        "content-type": content_type,
        "Idempotency-Key": str(uuid.uuid4()),
    }
    return httpx.post(url + path, content=raw, headers=headers, timeout=300)


def _session(worker: Any) -> str:
    with worker.client() as http:
        rid = http.post("/rl/model-resources", json={"base_model": "tiny-qwen"}).json()["id"]
        deadline = time.monotonic() + 300
        while http.get(f"/rl/model-resources/{rid}").json()["status"] != (
            "MODEL_RESOURCES_STATUS_READY"
        ):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        body = {"model_resources_id": rid, "lora_config": {"rank": 4}}
        sid: str = http.post("/rl/training-sessions", json=body).json()["id"]
        return sid


CASES = [
    # (face, shape, size in MB, the param of the 400)
    ("tinker-proto", "empty-datums", 8, "data"),
    ("tinker-proto", "empty-inputs", 8, "data[0].loss_fn_inputs"),
    ("tinker-json", "empty-datums", 16, "forward_backward_input.data"),
    ("tinker-json", "one-long-datum", 16, "forward_backward_input.data[0].model_input"),
    ("rl", "empty-samples", 16, "samples"),
    ("rl", "one-long-sample", 16, "samples[0].model_input"),
]


@pytest.mark.parametrize(("face", "shape", "size_mb", "param"), CASES)
def test_hostile_bodies_are_400s_within_memory_and_health(
    worker: Any, face: str, shape: str, size_mb: int, param: str
) -> None:
    sid = _session(worker) if face == "rl" else ""
    path = (
        f"/v1/rl/training-sessions/{sid}/operations/forward-backward"
        if face == "rl"
        else "/api/v1/forward_backward"
    )
    content_type = proto.PROTOBUF if face == "tinker-proto" else "application/json"
    warm = hostile_bodies(face, 2)[shape]  # starts the body parser's child
    assert _post(worker.url, path, warm, content_type).status_code == 400
    raw = hostile_bodies(face, size_mb)[shape]
    assert len(raw) >= size_mb * 1_000_000
    time.sleep(0.3)
    pids, before = reset_peaks(worker.pid)
    with HealthProbe(worker.url) as probe:
        response = _post(worker.url, path, raw, content_type)
    rise = (peak_kib(pids) - before) * 1024
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["message"].startswith(param), error
    bound = 3 * len(raw) + 64 * MIB
    assert rise < bound, f"{face} {shape}: resident sets rose {rise / MIB:.0f} MiB"
    print(f"{face} {shape}: +{rise / MIB:.0f} MiB, {len(probe.latencies)} probes", end=" ")
    assert probe.latencies, "no /healthz answered while the body was processed"
    slowest = max(probe.latencies)
    assert slowest < 1.5, f"{face} {shape}: /healthz took {slowest:.2f} s"
    assert "exceed" in error["message"] or "more than" in error["message"], error
