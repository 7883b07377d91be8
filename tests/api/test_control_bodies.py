"""The typed-body POSTs (create resource or session, estimate cost, extend expiry, stop) are
decoded by FastAPI itself, which reads the whole body before it checks the token. Their bodies
are capped at 1 MiB as they arrive: an unauthenticated client streaming a huge body gets a 413
without the worker buffering it, and real requests (under the cap) still work."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.api.conftest import serve_in_thread
from trainer.api.app import CONTROL_BODY_MAX

ROUTES = [
    "/rl/model-resources",
    "/rl/model-resources/estimate-cost",
    "/rl/model-resources/mr_x/extend-expiry",
    "/rl/model-resources/mr_x/stop",
    "/rl/training-sessions",
    "/rl/training-sessions/ts_x/stop",
]


def _rss_kib() -> int:
    with open(f"/proc/{os.getpid()}/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def live(tiny_qwen_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    with serve_in_thread(tmp_path_factory.mktemp("storage"), {"tiny-qwen": tiny_qwen_dir}) as s:
        yield s


@pytest.mark.parametrize("path", ROUTES)
def test_declared_oversize_body_is_413_before_auth(live: object, path: str) -> None:
    with live.client(token=None) as anonymous:  # type: ignore[attr-defined]
        response = anonymous.post(path, content=b"{" + b" " * (CONTROL_BODY_MAX + 1) + b"}")
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("body", "request_too_large")


def test_streamed_body_is_cut_off_without_buffering(live: object) -> None:
    """A chunked body with no declared length, 256 MiB if the worker read it all: refused at
    the cap, and the process (the worker runs in it) does not grow by the body."""
    sent = 0
    stop = threading.Event()

    def chunks() -> Iterator[bytes]:
        nonlocal sent
        block = b" " * (1 << 20)
        while sent < 256 << 20 and not stop.is_set():
            sent += len(block)
            yield block

    before = _rss_kib()
    with live.client(token=None) as anonymous:  # type: ignore[attr-defined]
        try:
            response = anonymous.post("/rl/model-resources", content=chunks())
            status = response.status_code
        except httpx.TransportError:  # the server answered and closed mid-upload
            status = 413
    stop.set()
    assert status == 413
    assert _rss_kib() - before < 128 << 10  # KiB: well under the 256 MiB body


def test_bodies_under_the_cap_still_work(live: object) -> None:
    with live.client() as http:  # type: ignore[attr-defined]
        body = {"base_model": "tiny-qwen", "lora_enabled": True}
        estimate = http.post("/rl/model-resources/estimate-cost", json=body)
        assert estimate.status_code == 200, estimate.text
        padded = http.post(
            "/rl/model-resources/estimate-cost",
            content=(b'{"base_model": "tiny-qwen"' + b" " * (CONTROL_BODY_MAX - 64) + b"}"),
            headers={"content-type": "application/json"},
        )
        assert padded.status_code == 200, padded.text
