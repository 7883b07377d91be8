"""A worker process (`python -m trainer serve --generator-backend vllm ...`) with vLLM
replicas: SIGTERM during a sample exits 0 and leaves no replica running; after a restart on
the same storage, a new resource samples on a new replica."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx

from tests.faults.procs import (
    new_resource,
    new_session,
    output,
    post_op,
    serve_child,
    terminate,
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _replica_pid(http: httpx.Client, rid: str) -> int:
    body = http.get(f"/rl/model-resources/{rid}").json()
    (replica,) = body["status_details"]["generator"]["replicas"]
    assert replica["state"] == "HEALTHY"
    return int(replica["pid"])


def _sample_body(tokens: int) -> dict:
    return {
        "model_inputs": [{"chunks": [{"encoded_text": {"tokens": [3, 4, 5]}}]}],
        "num_samples": 8,
        "sampling_params": {"max_tokens": tokens, "temperature": 1.0, "seed": 1},
    }


def test_sigterm_stops_the_replicas_and_a_restart_serves_again(
    vllm_model: Path, vllm_py: str, tmp_path: Path
) -> None:
    storage = tmp_path / "storage"
    flags = ("--generator-backend", "vllm", "--generator-python", vllm_py)
    with serve_child(storage, {"tiny": vllm_model}, *flags, "--generator-dtype", "float32") as w:
        with w.client() as http:
            rid = new_resource(http, "tiny", lora_enabled=True)
            sid = new_session(http, rid, lora_config={"rank": 4, "seed": 0})
            pid = _replica_pid(http, rid)
            assert _alive(pid)
            post_op(http, sid, "sample", _sample_body(240))  # running when SIGTERM comes
        threading.Event().wait(0.5)
        code, _ = terminate(w)
        assert code == 0
    deadline = time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), "a vLLM replica outlived its worker"
    with (
        serve_child(storage, {"tiny": vllm_model}, *flags, "--generator-dtype", "float32") as w,
        w.client() as http,
    ):
        stopped = http.get(f"/rl/model-resources/{rid}").json()
        assert stopped["status"] == "MODEL_RESOURCES_STATUS_STOPPED"
        rid = new_resource(http, "tiny", lora_enabled=True)
        sid = new_session(http, rid, lora_config={"rank": 4, "seed": 0})
        assert _alive(_replica_pid(http, rid))
        (result,) = output(http, sid, "sample", _sample_body(4))["results"]
        assert len(result["sequences"]) == 8
