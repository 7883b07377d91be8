"""`save_weights_external` over plain HTTP: the adapter alone in Tinker's naming, age-encrypted
to the request's recipients, what the worker then does with an export (loads a plain one back,
refuses to read an encrypted one, deletes an encrypted one's files with its name), and the TTL
route the cookbook's download calls. tinker-cookbook's own use of these is in
`test_weights_export.py`."""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path

import httpx
import pyrage
import pytest
from safetensors.torch import load

from tests.api.conftest import LiveServer
from tests.faults.procs import new_resource
from tests.tinker import tinker_http as th
from trainer.api.tinker import paths
from trainer.serving.tenants import LOCAL

FILES = ["adapter_config.json", "adapter_model.safetensors"]


def export(http: httpx.Client, model: str, name: str, recipients: list[str] | None = None) -> str:
    body = {"model_id": model, "path": name, "age_encryption_recipients": recipients}
    path: str = th.ok(http, "/save_weights_external", body)["path"]
    return path


def fetch(http: httpx.Client, path: str) -> dict[str, bytes]:
    """Every file of an external export, through its signed URLs (no key sent)."""
    run, _, name = paths.parse(path, "path")
    checkpoint = f"/training_runs/{run}/checkpoints/external_weights/{name}"
    response = http.get(f"{checkpoint}/external_weights_urls")
    assert response.status_code == 200, response.text
    return {f: httpx.get(url, timeout=60).content for f, url in response.json()["urls"].items()}


def test_an_encrypted_export_is_the_plain_one_sealed(
    live: LiveServer, http: httpx.Client, model: str
) -> None:
    alice, bob = pyrage.x25519.Identity.generate(), pyrage.x25519.Identity.generate()
    recipients = [str(alice.to_public()), str(bob.to_public())]
    plain = fetch(http, export(http, model, "plain"))
    sealed_path = export(http, model, "sealed", recipients)
    sealed = fetch(http, sealed_path)
    assert sorted(plain) == FILES
    assert sorted(sealed) == [f"{name}.age" for name in FILES]
    for name in FILES:  # each recipient alone decrypts every file
        for identity in (alice, bob):
            assert pyrage.decrypt(sealed[f"{name}.age"], [identity]) == plain[name]
    tensors = load(plain[FILES[1]])
    assert any(".unembed_tokens." in key for key in tensors)
    assert not any("lm_head" in key for key in tensors)
    # on the worker's disk: the ciphertext, the manifest and state.json (no weights), nothing
    # staged elsewhere
    record = paths.resolve(live.app.state.tinker, sealed_path, "path", LOCAL)
    on_disk = sorted(p.relative_to(record.path).as_posix() for p in record.path.rglob("*.*"))
    assert on_disk == [*(f"adapter/{name}.age" for name in FILES), "manifest.json", "state.json"]
    assert not any(live.worker.checkpoints.tmp.iterdir())


def test_the_worker_refuses_to_read_an_encrypted_export(
    live: LiveServer, http: httpx.Client, model: str
) -> None:
    recipient = str(pyrage.x25519.Identity.generate().to_public())
    path = export(http, model, "unreadable", [recipient])
    tinker_session = model.split(":")[0]
    refusals = [
        ("/load_weights", {"model_id": model, "path": path}, "path"),
        (
            "/create_sampling_session",
            {"session_id": tinker_session, "sampling_session_seq_id": 9, "model_path": path},
            "model_path",
        ),
    ]
    for route, body, field in refusals:
        response = http.post(route, json=body)
        assert response.status_code == 400, (route, response.text)
        error = response.json()["error"]
        assert error["param"] == field and "age-encrypted export" in error["message"], error
    engine_id = paths.resolve(live.app.state.tinker, path, "path", LOCAL).id
    with live.client() as rl:
        resource = new_resource(rl, th.BASE)
        body = {"model_resources_id": resource, "resume_from_checkpoint_id": engine_id}
        response = rl.post("/rl/training-sessions", json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "resume_from_checkpoint_id"
        merged = rl.get(
            f"/rl/checkpoints/{engine_id}/download",
            params={"variant": "CHECKPOINT_VARIANT_MERGED"},
        )
        assert merged.status_code == 400, merged.text
        assert merged.json()["error"]["param"] == "variant"
        adapter = rl.get(
            f"/rl/checkpoints/{engine_id}/download",
            params={"variant": "CHECKPOINT_VARIANT_ADAPTER"},
        )
        assert sorted(f["filename"] for f in adapter.json()["data"]) == [f"{n}.age" for n in FILES]


def test_a_plain_export_loads_back(http: httpx.Client, model: str) -> None:
    """Tinker's naming reads back as PEFT's: a model loaded from the export computes what
    the exported model did."""
    th.ok(http, "/forward_backward", th.fb_body(model))
    th.ok(http, "/optim_step", th.optim_body(model, lr=0.05))
    before = th.forward(http, model)
    path = export(http, model, "round-trip")
    loaded = f"{model.split(':')[0]}:train:77"
    body = {"session_id": model.split(":")[0], "model_seq_id": 77, "path": path}
    th.ok(http, "/load_weights", body)
    assert th.forward(http, loaded) == pytest.approx(before, abs=1e-6)


def test_deleting_an_encrypted_export_deletes_its_files(
    live: LiveServer, http: httpx.Client, model: str
) -> None:
    recipient = str(pyrage.x25519.Identity.generate().to_public())
    bridge, store = live.app.state.tinker, live.worker.checkpoints
    kept, gone = export(http, model, "kept"), export(http, model, "gone", [recipient])
    records = {p: paths.resolve(bridge, p, "path", LOCAL) for p in (kept, gone)}
    for path in (kept, gone):
        run, _, name = paths.parse(path, "path")
        response = http.delete(f"/training_runs/{run}/checkpoints/external_weights/{name}")
        assert response.status_code == 200, response.text
    assert store.get(records[kept].id) is not None  # forgotten by name only
    assert store.get(records[gone].id) is None
    assert not Path(records[gone].path).exists()
    listed = http.get(f"/training_runs/{model}/checkpoints").json()["checkpoints"]
    assert not {kept, gone} & {c["tinker_path"] for c in listed}


def test_a_checkpoint_ttl_is_recorded(live: LiveServer, http: httpx.Client, model: str) -> None:
    path = export(http, model, "ttl")
    run, _, name = paths.parse(path, "path")
    url = f"/training_runs/{run}/checkpoints/external_weights/{name}/ttl"

    def expires() -> str | None:
        listed = http.get(f"/training_runs/{model}/checkpoints").json()["checkpoints"]
        found: str | None = next(c for c in listed if c["tinker_path"] == path)["expires_at"]
        return found

    assert expires() is None
    start = time.time()
    assert http.put(url, json={"ttl_seconds": 3600}).status_code == 200
    stamp = expires()
    assert stamp is not None
    at = datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    assert start + 3600 - 5 <= at <= time.time() + 3600 + 5
    assert http.put(url, json={"ttl_seconds": None}).status_code == 200
    assert expires() is None
    bad = http.put(url, json={"ttl_seconds": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "ttl_seconds", bad.text
    missing = http.put(f"/training_runs/{run}/checkpoints/external_weights/nope/ttl", json={})
    assert missing.status_code == 404, missing.text
