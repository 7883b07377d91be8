"""Hostile input on the Fireworks control plane: every field of the SDK's create body, the
promote body and the queries, swapped for values of every JSON type, and garbage paths under
the gateway. Each answer is a 2xx or a 4xx naming what it refused, never a 5xx; a refused
create leaves no job behind. Seeded, so a failure reproduces."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.conftest import TOKEN, LiveServer, serve_in_thread
from tests.fireworks.conftest import QWEN

pytestmark = pytest.mark.fireworks

HOSTILE: list[Any] = [
    None,
    True,
    -1,
    0,
    2**63,
    1e308,
    -0.5,
    "",
    "x" * 5000,
    "\ud800",
    "../../etc/passwd",
    "accounts/other/models/x",
    [],
    [1, "a", None],
    {},
    {"nested": {"deep": [1, 2]}},
]
BODY: dict[str, Any] = {
    "serviceMode": True,
    "keepAlive": False,
    "dataset": "",
    "displayName": "fuzz",
    "trainingConfig": {
        "baseModel": QWEN,
        "loraRank": 8,
        "learningRate": 1e-5,
        "maxContextLength": 64,
        "region": "US_OHIO_1",
        "acceleratorType": "NVIDIA_H100_80GB",
        "acceleratorCount": 1,
        "extraArgs": ["--a"],
    },
    "nodeCount": 1,
    "useReservation": False,
    "forwardOnly": False,
    "hotLoadDeploymentId": "d",
    "extraValues": {"k": "v"},
    "inactivityTimeout": "1800s",
    "purpose": "p",
    "preemptible": False,
    "managedBy": "m",
    "rewardWeights": ["r=1"],
}


@pytest.fixture(scope="module")
def live(fw_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with serve_in_thread(tmp_path_factory.mktemp("fw-fuzz"), fw_models) as server:
        yield server


def answered(r: httpx.Response) -> None:
    assert r.status_code < 500, (r.request.method, r.request.url, r.status_code, r.text[:400])
    if r.status_code >= 400:
        error = r.json()["error"]
        assert error["message"], r.text[:400]


def post(c: httpx.Client, url: str, body: Any, **params: str) -> httpx.Response:
    """`body` as JSON text, lone surrogates escaped as JSON allows (`"\\ud800"`)."""
    content = json.dumps(body)
    return c.post(url, params=params, content=content, headers={"Content-Type": "application/json"})


def mutations(rng: random.Random, count: int) -> Iterator[dict[str, Any]]:
    paths = [(k,) for k in BODY] + [("trainingConfig", k) for k in BODY["trainingConfig"]]
    for _ in range(count):
        body = {**BODY, "trainingConfig": dict(BODY["trainingConfig"])}
        for path in rng.sample(paths, rng.randint(1, 3)):
            target = body if len(path) == 1 else body["trainingConfig"]
            if isinstance(target, dict):  # not when trainingConfig itself was replaced
                target[path[-1]] = rng.choice(HOSTILE)
        yield body


def test_hostile_create_bodies_and_queries_never_answer_5xx(live: LiveServer) -> None:
    rng = random.Random(31)
    headers = {"X-Api-Key": TOKEN}
    jobs = "/v1/accounts/local/rlorTrainerJobs"
    with httpx.Client(base_url=live.url, headers=headers, timeout=120) as c:
        made = 0
        for i, body in enumerate(mutations(rng, 120)):
            r = post(c, jobs, body, rlorTrainerJobId=f"fuzz-{i}")
            answered(r)
            if r.status_code >= 400:
                assert c.get(f"{jobs}/fuzz-{i}").status_code == 404  # nothing left behind
            else:
                made += 1
                answered(c.delete(f"{jobs}/fuzz-{i}"))
        assert made > 0  # the hostile values of free-text fields are taken, not all refused
        for value in HOSTILE:
            text = str(value)[:300].encode("utf-8", "backslashreplace").decode()
            for params in (
                {"pageSize": text},
                {"pageToken": text},
                {"filter": text},
                {"orderBy": text},
                {"rlorTrainerJobId": text},
            ):
                answered(c.get(jobs, params=params))
            answered(post(c, jobs, BODY, rlorTrainerJobId=text))
            promote = {"output_model": value, "trainer_job_id": value, "base_model": value}
            answered(post(c, "/v1/accounts/local/checkpoints/c:promote", promote))
            answered(post(c, "/v1/accounts/local/checkpoints/c:promote", value))
        for raw in (b"", b"{", b"[]", b"null", b'{"trainingConfig": 1}', b"\xff\xfe"):
            answered(c.post(jobs, content=raw, headers={"Content-Type": "application/json"}))


def test_garbage_gateway_paths_never_answer_5xx(live: LiveServer) -> None:
    headers = {"X-Api-Key": TOKEN}
    with httpx.Client(base_url=live.url, headers=headers, timeout=60) as c:
        for path in (
            "/training/v1/rlorTrainerJobs/",
            "/training/v1/rlorTrainerJobs/local",
            "/training/v1/rlorTrainerJobs/local/",
            "/training/v1/rlorTrainerJobs/local/nojob/api/v1/healthz",
            "/training/v1/rlorTrainerJobs/local/nojob/api/v2/healthz",
            "/training/v1/rlorTrainerJobs/other/nojob/api/v1/create_model",
            "/training/v1/rlorTrainerJobs/local/%2e%2e/api/v1/healthz",
            "/training/v1/rlorTrainerJobs/local/" + "j" * 4000 + "/api/v1/healthz",
        ):
            answered(c.get(path))
            answered(c.post(path, json={}))
