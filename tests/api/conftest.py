"""A live worker on 127.0.0.1 (uvicorn in a thread) serving two tiny random models.

`tiny-qwen` is tied (Qwen3-shaped), `tiny-llama` untied; both come from the shared fixtures in
`tests/conftest.py`, built from a config and saved to a temp dir, then loaded by the real
engine. Nothing is mocked: requests go over TCP to the real app and the real engine.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from trainer.api.app import create_app
from trainer.api.keys import KeyRing
from trainer.serving.config import ServeConfig
from trainer.serving.worker import Worker
from trainer.spawn import free_port

TOKEN = "test-token-0123456789"


@dataclass
class LiveServer:
    url: str  # http://127.0.0.1:PORT
    token: str
    worker: Worker
    app: Any
    storage: Path

    @property
    def api(self) -> str:
        return f"{self.url}/v1"

    def client(self, token: str | None = TOKEN) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.api, headers=headers, timeout=120)


@contextlib.contextmanager
def serve_in_thread(
    storage: Path,
    models: dict[str, Path],
    token: str | None = TOKEN,
    keys: KeyRing | None = None,
    **settings: Any,
) -> Iterator[LiveServer]:
    """`keys`: the users of a keys file (then `token` is not a key)."""
    port = free_port()
    config = ServeConfig.model_validate(
        {
            "host": "127.0.0.1",
            "port": port,
            "storage": storage,
            "model": [{"name": n, "location": str(p)} for n, p in models.items()],
            "device": "cpu",
            "expiry_check_s": 0.5,
            **settings,
        }
    )
    worker = Worker(config)
    app = create_app(worker, token, keys)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", token or "", worker, app, storage)
    finally:
        server.should_exit = True
        thread.join(60)


@pytest.fixture(scope="module")
def models(tiny_qwen_dir: Path, tiny_llama_dir: Path) -> dict[str, Path]:
    return {"tiny-qwen": tiny_qwen_dir, "tiny-llama": tiny_llama_dir}


@pytest.fixture(scope="module")
def server(
    models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    # Small result-offload threshold so large outputs go out by payload, as the SDK expects;
    # a small inline-body cap to test 413; a model that cannot load to test ERROR.
    served = {**models, "broken": Path("/nonexistent/model")}
    with serve_in_thread(
        tmp_path_factory.mktemp("storage"),
        served,
        result_offload_bytes=64 * 1024,
        max_body_bytes=1 << 20,
    ) as live:
        yield live


def wait_status(client: httpx.Client, path: str, wanted: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        body = client.get(path).json()
        if body.get("status") == wanted:
            return body
        if str(body.get("status")).endswith(("_ERROR", "_STOPPED", "_EXPIRED")):
            raise AssertionError(f"{path} is {body.get('status')}, not {wanted}: {body}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} stuck in {body.get('status')}: {body}")
        time.sleep(0.05)
