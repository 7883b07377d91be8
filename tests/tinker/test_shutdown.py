"""SIGTERM drains the Tinker face as it drains the RL face: a real worker process, with a
Tinker forward-backward running, an optim step queued behind it and a sample in flight on a
sampling session, exits 0 within the grace. The running requests finish (or, past a short
grace, fail cleanly), the queued one fails cleanly, and after a restart every future is
served: finished ones with their results, none pending; nothing in the log is a crash on a
closed database."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.faults.procs import TOKEN, forked_worker, terminate
from tests.tinker import tinker_http as th

BASE = th.BASE


def tinker_client(url: str) -> httpx.Client:
    headers = {"X-API-Key": f"tml-{TOKEN}"}
    return httpx.Client(base_url=f"{url}{th.PREFIX}", headers=headers, timeout=120)


def heavy_forward_backward(model: str, count: int, length: int) -> dict[str, Any]:
    rng = random.Random(0)
    body = th.fb_body(model)
    body["forward_backward_input"]["data"] = [
        th.datum([rng.randrange(2, 100) for _ in range(length)]) for _ in range(count)
    ]
    return body


def post(http: httpx.Client, path: str, body: dict[str, Any]) -> str:
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    request_id: str = response.json()["request_id"]
    return request_id


def settled_cleanly(http: httpx.Client, request_id: str) -> dict[str, Any]:
    """The future after the restart: a result, or a clean server-category failure."""
    result = th.wait(http, request_id, timeout=15)
    if "error" in result:
        assert set(result) == {"error", "category"}, result
        assert result["category"] == "server", result
        assert "shut down" in result["error"] or "restarted" in result["error"], result
        assert "closed database" not in result["error"], result
    return result


def in_flight(http: httpx.Client, count: int) -> dict[str, Any]:
    """A finished forward (and its result), then a forward-backward of `count` long datums,
    60 small ones queued behind it on the same model, and a sample on a sampling session."""
    model = th.new_model(http)
    done = post(http, "/forward_backward", th.fb_body(model, True))
    body = {"session_id": model.split(":")[0], "sampling_session_seq_id": 0, "base_model": BASE}
    sampler = http.post("/create_sampling_session", json=body).json()["sampling_session_id"]
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [3, 4]}]}
    sample = {
        "sampling_session_id": sampler,
        "prompt": prompt,
        "num_samples": 4,
        "sampling_params": {"max_tokens": 48, "seed": 0},
    }
    return {
        "done": (done, th.wait(http, done)),
        "running": post(http, "/forward_backward", heavy_forward_backward(model, count, 500)),
        "queued": [post(http, "/forward_backward", th.fb_body(model)) for _ in range(60)],
        "sample": post(http, "/asample", sample),
    }


@pytest.mark.parametrize(
    ("grace", "count", "finishes"),
    [(30.0, 24, True), (0.5, 128, False)],
    ids=["finishes-within-grace", "fails-cleanly-after-grace"],
)
def test_sigterm_during_tinker_requests(
    tiny_qwen_dir: Path, tmp_path: Path, grace: float, count: int, finishes: bool
) -> None:
    storage, models = tmp_path / "storage", {BASE: tiny_qwen_dir}
    config = tmp_path / "serve.toml"
    config.write_text(f"shutdown_grace_s = {grace}\n")
    first = forked_worker(storage, models, tmp_path / "first.log", "--config", str(config))
    with first as worker, tinker_client(worker.url) as http:
        ids = in_flight(http, count)
        time.sleep(0.2)  # the forward-backward and the sample are in the engine
        code, took = terminate(worker)
    text = worker.log()
    assert code == 0, text[-4000:]
    assert took < grace + 20, f"exit took {took:.1f}s with a grace of {grace}s"
    assert "closed database" not in text and "crashed" not in text, text[-4000:]

    second = forked_worker(storage, models, tmp_path / "second.log")
    with second as again, tinker_client(again.url) as http:
        done, before = ids["done"]
        assert th.wait(http, done, timeout=15) == before
        ran = settled_cleanly(http, ids["running"])
        assert ("error" not in ran) == finishes, ran
        outcomes = [settled_cleanly(http, request_id) for request_id in ids["queued"]]
        not_run = [o for o in outcomes if "before this request ran" in o.get("error", "")]
        assert len(not_run) > len(outcomes) // 2, outcomes  # queued behind the running one
        sampled = settled_cleanly(http, ids["sample"])
        if finishes:
            assert len(sampled["sequences"]) == 4, sampled
