"""Signed URLs are built on the worker's bound address (or `public_url`), never on the
request's `Host` header, on both faces: the Tinker face's `external_weights_urls`, the RL
face's checkpoint downloads and payload uploads."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from tests.api.conftest import LiveServer
from tests.tinker import tinker_http as th
from trainer.api.http import base_url
from trainer.api.tinker.records import TinkerCheckpoint, TinkerModel

FORGED = {"Host": "evil.example:666"}


def test_a_forged_host_gets_urls_on_the_bound_address(
    live: LiveServer, http: httpx.Client, model: str
) -> None:
    path = th.ok(http, "/save_weights_external", {"model_id": model, "path": "forged"})["path"]
    checkpoint_id = path.split("/", 3)[3]
    tinker = http.get(
        f"/training_runs/{model}/checkpoints/{checkpoint_id}/external_weights_urls",
        headers=FORGED,
    )
    assert tinker.status_code == 200, tinker.text
    urls = list(tinker.json()["urls"].values())
    engine = live.app.state.tinker.db.get(TinkerCheckpoint, path).checkpoint_id
    session = live.app.state.tinker.db.get(TinkerModel, model).session_id
    with live.client() as rl:
        files = rl.get(
            f"/rl/checkpoints/{engine}/download",
            params={"variant": "CHECKPOINT_VARIANT_ADAPTER"},
            headers=FORGED,
        )
        assert files.status_code == 200, files.text
        urls += [f["url"] for f in files.json()["data"]]
        upload = rl.post(f"/rl/training-sessions/{session}/payloads/upload-url", headers=FORGED)
        assert upload.status_code == 200, upload.text
        urls.append(upload.json()["upload_url"])
    assert len(urls) >= 5
    for url in urls:
        assert url.startswith(f"{live.url}/v1/rl/"), url
    assert httpx.get(urls[0]).status_code == 200


def fake_request(server: tuple[str, int], **config: Any) -> Any:
    settings = SimpleNamespace(**{"public_url": None, "host": "127.0.0.1", "port": 8321, **config})
    app = SimpleNamespace(state=SimpleNamespace(worker=SimpleNamespace(config=settings)))
    return SimpleNamespace(app=app, scope={"server": server}, headers={"host": "evil:1"})


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({}, "http://127.0.0.1:8321"),
        ({"host": "localhost", "port": 9000}, "http://localhost:9000"),
        ({"host": "0.0.0.0"}, "http://10.1.2.3:8321"),  # the connection's local address
        ({"host": "::"}, "http://10.1.2.3:8321"),
        ({"host": "::1", "port": 7000}, "http://[::1]:7000"),
        ({"port": 0}, "http://127.0.0.1:4444"),  # the port the socket got
        ({"public_url": "https://trainer.example/base/"}, "https://trainer.example/base"),
    ],
)
def test_signed_url_base(config: dict[str, Any], expected: str) -> None:
    assert base_url(fake_request(("10.1.2.3", 4444), **config)) == expected
