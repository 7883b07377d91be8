"""`GET /v1/rl/worker-metrics` (`trainer/api/rl/routes_metrics.py`): the scheduler's counters of a
live worker. Two sessions of one LoRA resource send forward-backwards at once through the HTTP
queues; the counters say they shared a pass, and each result equals the same call made alone
afterwards on a twin session (same seed, same samples). The route needs the token."""

from __future__ import annotations

import math
import threading
import uuid
from pathlib import Path
from typing import Any

import httpx
from api_helpers import ce_sample
from conftest import serve_in_thread, wait_status

CE = {"type": "LOSS_TYPE_CROSS_ENTROPY"}
SEQUENCES = [[5, 9, 17, 3, 44, 2, 8], [7, 7, 30, 12, 6], [90, 4, 11, 60, 21, 33, 5, 1]]


def _op(http: httpx.Client, sid: str, body: dict[str, Any]) -> dict[str, Any]:
    url = f"/rl/training-sessions/{sid}/operations/forward-backward"
    response = http.post(url, json=body, headers={"Idempotency-Key": uuid.uuid4().hex})
    assert response.status_code == 200, response.text
    op: dict[str, Any] = response.json()
    while not op["status"].endswith(("COMPLETED", "FAILED")):
        op = http.get(f"{url}/{op['id']}").json()
    assert op["status"].endswith("COMPLETED"), op
    return dict(op["output"])


def _session(http: httpx.Client, rid: str, rank: int) -> str:
    body = {"model_resources_id": rid, "lora_config": {"rank": rank, "seed": rank}}
    response = http.post("/rl/training-sessions", json=body)
    assert response.status_code == 200, response.text
    return str(response.json()["id"])


def test_worker_metrics_count_merged_passes(tiny_qwen_dir: Path, tmp_path: Path) -> None:
    engine = {"merge_window_ms": 300.0}
    with (
        serve_in_thread(tmp_path / "s", {"tiny-qwen": tiny_qwen_dir}, engine=engine) as live,
        live.client() as http,
    ):
        response = http.post("/rl/model-resources", json={"base_model": "tiny-qwen"})
        rid = response.json()["id"]
        wait_status(http, f"/rl/model-resources/{rid}", "MODEL_RESOURCES_STATUS_READY")
        before = http.get("/rl/worker-metrics").json()
        assert before["merged_passes"] == 0 and before["per_resource"][rid]["passes"] == 0
        sids = [_session(http, rid, rank) for rank in (4, 8)]
        body = {"loss": CE, "samples": [ce_sample(s) for s in SEQUENCES]}
        outputs: dict[str, dict[str, Any]] = {}

        def send(sid: str) -> None:
            with live.client() as client:
                outputs[sid] = _op(client, sid, body)

        threads = [threading.Thread(target=send, args=(sid,)) for sid in sids]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        metrics = http.get("/rl/worker-metrics").json()
        twins = [_session(http, rid, rank) for rank in (4, 8)]
        alone = [_op(http, sid, body) for sid in twins]  # one at a time: solo passes
        with live.client(None) as anonymous:
            assert anonymous.get("/rl/worker-metrics").status_code == 401
    mine = metrics["per_resource"][rid]
    assert mine["merged_passes"] >= 1 and mine["max_sessions_per_pass"] == 2, metrics
    assert metrics["merged_items"] == mine["merged_items"] == 2, metrics
    for sid, solo in zip(sids, alone, strict=True):
        assert math.isclose(outputs[sid]["loss"], solo["loss"], rel_tol=1e-6), (outputs, alone)
