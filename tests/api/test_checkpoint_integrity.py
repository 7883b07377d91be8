"""Checkpoint integrity, listing order and download errors over the live API.
Nothing is mocked: a worker on tiny models, files tampered with on disk, expected
hashes computed here with hashlib from the bytes."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import threading
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import together
from api_helpers import ce_sample
from conftest import TOKEN, LiveServer, serve_in_thread
from together import Together
from together.post_training import download_checkpoint

from tests.faults.procs import output, tiny_session
from trainer.checkpoint.store import INFERENCE, TRAINING, CheckpointStore

CE = {"type": "LOSS_TYPE_CROSS_ENTROPY"}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def new_session(http: httpx.Client, lora: bool = True) -> str:
    sid = tiny_session(http, lora)
    output(http, sid, "forward-backward", {"loss": CE, "samples": [ce_sample(list(range(3, 20)))]})
    output(http, sid, "optim-step", {})
    return sid


@pytest.fixture(scope="module")
def http(server: LiveServer) -> Any:
    with server.client() as client:
        yield client


@pytest.fixture(scope="module")
def sid(http: httpx.Client) -> str:
    return new_session(http)


def _checkpoint(http: httpx.Client, sid: str, kind: str = "inference-checkpoint") -> str:
    ckpt_id: str = output(http, sid, kind)["checkpoint"]["id"]
    return ckpt_id


def _on_disk(server: LiveServer, ckpt_id: str) -> dict[str, bytes]:
    root = server.storage / "checkpoints" / ckpt_id
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "manifest.json"
    }


# -- item 11: newest first, keyset pagination --------------------------------------------------


def test_listing_is_newest_first_and_pages_stay_stable(http: httpx.Client, server: LiveServer):
    sid = new_session(http)
    created = [_checkpoint(http, sid, "training-checkpoint") for _ in range(5)]
    expected = created[::-1]  # each was created after the previous one completed

    def page(after: str) -> dict[str, Any]:
        params = {"session_id": sid, "limit": 2, "after": after}
        body: dict[str, Any] = http.get("/rl/checkpoints", params=params).json()
        return body

    first = page("")
    assert [c["id"] for c in first["data"]] == expected[:2]
    assert first["meta"] == {"has_more": True, "limit": 2, "next_cursor": expected[1]}
    newer = _checkpoint(http, sid, "training-checkpoint")  # lands between page 1 and page 2
    second = page(first["meta"]["next_cursor"])
    third = page(second["meta"]["next_cursor"])
    assert [c["id"] for c in second["data"]] == expected[2:4]
    assert [c["id"] for c in third["data"]] == expected[4:]
    assert third["meta"]["has_more"] is False and third["meta"]["next_cursor"] == ""
    fresh = http.get("/rl/checkpoints", params={"session_id": sid, "limit": 100}).json()
    assert [c["id"] for c in fresh["data"]] == [newer, *expected]

    # the SDK's way to recover the latest checkpoint for a resume
    client = Together(api_key=TOKEN, base_url=server.api)
    latest = client.post_training.checkpoints.list(session_id=sid, limit=1)
    assert [c.id for c in latest.data] == [newer]
    # the session object keeps its own checkpoints in creation order
    view = http.get(f"/rl/training-sessions/{sid}").json()
    assert [c["id"] for c in view["training_checkpoints"]] == [*created, newer]


def test_equal_timestamps_are_ordered_by_id_across_pages(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    records = [
        store.write(
            type=TRAINING,
            session_id="s",
            step=i,
            base_model="m",
            lora_rank=None,
            writer=lambda out: (out / "state.json").write_text("{}"),
        )
        for i in range(7)
    ]
    with store._lock:  # ties: the clock's resolution, or two writers in the same tick
        store._db.execute(
            "UPDATE checkpoints SET created_at = 100.0 WHERE id IN (?, ?, ?, ?)",
            [r.id for r in records[1:5]],
        )
        store._db.commit()
    rows = [store.get(r.id) for r in records]
    reference = sorted(rows, key=lambda r: (r.created_at, r.id), reverse=True)  # type: ignore
    paged: list[Any] = []
    after = None
    while True:
        chunk = store.list(after=after, limit=2)
        paged += chunk
        if len(chunk) < 2:
            break
        after = chunk[-1].id
    assert [r.id for r in paged] == [r.id for r in reference]  # type: ignore[union-attr]
    assert store.list(oldest_first=True, limit=100) == reference[::-1]
    with pytest.raises(KeyError):
        store.list(after="ckpt-" + "0" * 32)
    store.close()


def test_unknown_cursor_is_a_400_naming_after(http: httpx.Client) -> None:
    response = http.get("/rl/checkpoints", params={"after": "ckpt-" + "f" * 32})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "after" and error["message"].startswith("after: ")


# -- item 8: hashes where the API has room, downloads verified ----------------------------------


def test_listing_get_and_download_carry_file_hashes(
    http: httpx.Client, server: LiveServer, sid: str
) -> None:
    ckpt_id = _checkpoint(http, sid)
    on_disk = _on_disk(server, ckpt_id)
    expected = [
        {"path": rel, "size": len(data), "sha256": _sha(data)} for rel, data in on_disk.items()
    ]
    assert http.get(f"/rl/checkpoints/{ckpt_id}").json()["files"] == expected
    listed = http.get("/rl/checkpoints", params={"session_id": sid, "limit": 100}).json()
    assert next(c for c in listed["data"] if c["id"] == ckpt_id)["files"] == expected
    sdk = Together(api_key=TOKEN, base_url=server.api).post_training.checkpoints
    assert sdk.retrieve(ckpt_id).files == expected  # type: ignore[attr-defined]
    for variant, sub in (("CHECKPOINT_VARIANT_MERGED", "merged"), ("ADAPTER", "adapter")):
        variant = variant if variant.startswith("CHECKPOINT") else f"CHECKPOINT_VARIANT_{variant}"
        files = http.get(f"/rl/checkpoints/{ckpt_id}/download", params={"variant": variant})
        names = {f["filename"] for f in files.json()["data"]}
        assert names == {rel[len(sub) + 1 :] for rel in on_disk if rel.startswith(sub + "/")}
        for entry in files.json()["data"]:
            data = on_disk[f"{sub}/{entry['filename']}"]
            assert (entry["size"], entry["sha256"]) == (len(data), _sha(data))
            fetched = httpx.get(entry["url"])
            assert fetched.status_code == 200 and fetched.content == data


def test_download_refuses_tampered_and_missing_files(
    http: httpx.Client, server: LiveServer, sid: str, tmp_path: Path
) -> None:
    ckpt_id = _checkpoint(http, sid)
    root = server.storage / "checkpoints" / ckpt_id
    params = {"variant": "CHECKPOINT_VARIANT_ADAPTER"}
    entries = http.get(f"/rl/checkpoints/{ckpt_id}/download", params=params).json()["data"]
    urls = {e["filename"]: e["url"] for e in entries}
    weights = root / "adapter" / "adapter_model.safetensors"
    good = weights.read_bytes()
    assert httpx.get(urls["adapter_model.safetensors"]).content == good  # verified, remembered

    flipped = bytearray(good)
    flipped[-1] ^= 0xFF  # same size, one bit pattern changed: only the hash can tell
    with open(weights, "r+b") as fh:
        fh.write(flipped)
    refused = httpx.get(urls["adapter_model.safetensors"])
    assert refused.status_code == 409, refused.content[:200]
    error = refused.json()["error"]
    assert error["code"] == "checkpoint_corrupt" and error["param"] == "checkpoint_id"
    assert ckpt_id in error["message"] and "adapter/adapter_model.safetensors" in error["message"]
    client = Together(api_key=TOKEN, base_url=server.api, max_retries=0)
    with pytest.raises(together.ConflictError, match=re.escape("adapter_model.safetensors")):
        download_checkpoint(
            client, ckpt_id, variant="CHECKPOINT_VARIANT_ADAPTER", output_dir=tmp_path / "a"
        )

    weights.write_bytes(good)  # put back: served again, and it is the original
    restored = httpx.get(urls["adapter_model.safetensors"])
    assert restored.status_code == 200 and restored.content == good

    (root / "adapter" / "adapter_config.json").unlink()
    missing = http.get(f"/rl/checkpoints/{ckpt_id}/download", params=params)
    assert missing.status_code == 409
    assert "adapter/adapter_config.json is missing" in missing.json()["error"]["message"]
    assert httpx.get(urls["adapter_config.json"]).status_code == 409
    with pytest.raises(together.ConflictError, match=re.escape("adapter_config.json is missing")):
        client.post_training.checkpoints.download(id=ckpt_id, variant="CHECKPOINT_VARIANT_ADAPTER")
    # the merged variant of the same checkpoint is intact and still downloads
    merged = download_checkpoint(
        client, ckpt_id, variant="CHECKPOINT_VARIANT_MERGED", output_dir=tmp_path / "m"
    )
    for path in merged:
        assert path.read_bytes() == (root / "merged" / path.name).read_bytes()


def test_concurrent_downloads_of_a_large_file_hash_it_once(
    server: LiveServer, http: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainer.checkpoint import files as checkpoint_files

    blob = os.urandom(48 << 20)

    def writer(out: Path) -> None:
        (out / "merged").mkdir()
        (out / "merged" / "model.safetensors").write_bytes(blob)

    record = server.worker.checkpoints.write(
        type=INFERENCE, session_id="s", step=0, base_model="tiny-qwen", lora_rank=None,
        writer=writer,
    )  # fmt: skip
    hashed: list[Path] = []
    real = checkpoint_files.sha256_file

    def counting(path: Path) -> str:
        hashed.append(path)
        return real(path)

    monkeypatch.setattr(checkpoint_files, "sha256_file", counting)
    entry = http.get(f"/rl/checkpoints/{record.id}/download").json()["data"][0]
    assert (entry["size"], entry["sha256"]) == (len(blob), _sha(blob))
    results: list[tuple[int, str]] = []

    def fetch() -> None:
        response = httpx.get(entry["url"], timeout=120)
        results.append((response.status_code, _sha(response.content)))

    threads = [threading.Thread(target=fetch) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    fetch()
    assert results == [(200, _sha(blob))] * 9
    assert hashed == [record.path / "merged" / "model.safetensors"]  # once, not 9 times


# -- item 16: download errors -----------------------------------------------------------------


def test_unspecified_variant_means_merged(
    http: httpx.Client, server: LiveServer, sid: str, tmp_path: Path
) -> None:
    ckpt_id = _checkpoint(http, sid)
    url = f"/rl/checkpoints/{ckpt_id}/download"

    def names(params: dict[str, str]) -> list[str]:
        response = http.get(url, params=params)
        assert response.status_code == 200, response.text
        return [f["filename"] for f in response.json()["data"]]

    merged = names({"variant": "CHECKPOINT_VARIANT_MERGED"})
    assert "model.safetensors" in merged
    assert names({"variant": "CHECKPOINT_VARIANT_UNSPECIFIED"}) == merged
    assert names({}) == merged
    client = Together(api_key=TOKEN, base_url=server.api)
    files = download_checkpoint(
        client, ckpt_id, variant="CHECKPOINT_VARIANT_UNSPECIFIED", output_dir=tmp_path
    )
    assert sorted(p.name for p in files) == sorted(merged)
    bogus = http.get(url, params={"variant": "CHECKPOINT_VARIANT_LORA"})
    assert bogus.status_code == 400 and bogus.json()["error"]["param"] == "variant"


def test_training_checkpoints_are_not_downloadable(http: httpx.Client, sid: str) -> None:
    ckpt_id = _checkpoint(http, sid, "training-checkpoint")
    for variant in ("CHECKPOINT_VARIANT_MERGED", "CHECKPOINT_VARIANT_ADAPTER"):
        response = http.get(f"/rl/checkpoints/{ckpt_id}/download", params={"variant": variant})
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "checkpoint_id"
        assert "only inference checkpoints can be downloaded" in error["message"]
        assert "has no" not in error["message"]


def test_full_weight_adapter_variant_names_the_reason(http: httpx.Client) -> None:
    sid = new_session(http, lora=False)
    ckpt_id = _checkpoint(http, sid)
    response = http.get(
        f"/rl/checkpoints/{ckpt_id}/download", params={"variant": "CHECKPOINT_VARIANT_ADAPTER"}
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "variant" and "full-weight" in error["message"]


# -- item 8: damaged directories at start-up ----------------------------------------------------


def _new_id() -> str:
    return f"ckpt-{uuid.uuid4().hex}"


def test_worker_starts_and_quarantines_damaged_checkpoint_dirs(
    tiny_qwen_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    storage = tmp_path / "storage"
    store = CheckpointStore(storage)

    def write(step: int) -> str:
        def writer(out: Path) -> None:
            (out / "merged").mkdir()
            (out / "merged" / "model.safetensors").write_bytes(os.urandom(1000 + step))
            (out / "state.json").write_text(json.dumps({"step": step}))

        return store.write(
            type=INFERENCE, session_id="s", step=step, base_model="tiny-qwen", lora_rank=None,
            writer=writer,
        ).id  # fmt: skip

    kept, adopted, short, unmanifested = write(1), write(2), write(3), write(4)
    with store._lock:  # a crash between the rename and the catalogue insert, for two of them
        store._db.execute("DELETE FROM checkpoints WHERE id IN (?, ?)", (adopted, short))
        store._db.commit()
    store.close()
    ckpts = storage / "checkpoints"
    (ckpts / short / "merged" / "model.safetensors").write_bytes(b"cut short")
    (ckpts / unmanifested / "manifest.json").unlink()  # catalogued, manifest gone
    garbled, bare = _new_id(), _new_id()  # uncatalogued: unreadable manifest, no manifest
    (ckpts / garbled).mkdir()
    (ckpts / garbled / "manifest.json").write_text('{"record": {"id": "ckpt-')
    (ckpts / garbled / "weights.safetensors").write_bytes(b"precious")
    (ckpts / bare).mkdir()
    (ckpts / bare / "weights.safetensors").write_bytes(b"also precious")
    damaged = {short, unmanifested, garbled, bare}
    before = {
        name: {
            p.relative_to(ckpts / name).as_posix(): p.read_bytes()
            for p in (ckpts / name).rglob("*")
            if p.is_file()
        }
        for name in damaged
    }

    with (
        caplog.at_level(logging.WARNING, logger="trainer.checkpoint.store"),
        serve_in_thread(storage, {"tiny-qwen": tiny_qwen_dir}) as live,
        live.client() as client,
    ):
        listed = client.get("/rl/checkpoints", params={"limit": 100}).json()["data"]
        assert [c["id"] for c in listed] == [adopted, kept]  # newest first
        assert client.get(f"/rl/checkpoints/{garbled}").status_code == 404
    assert {p.name for p in ckpts.iterdir()} == {kept, adopted}
    quarantined = {p.name[: len(kept)]: p for p in (storage / "quarantine").iterdir()}
    assert set(quarantined) == damaged
    for name, files in before.items():  # moved aside whole, nothing lost
        moved = quarantined[name]
        assert {
            p.relative_to(moved).as_posix(): p.read_bytes() for p in moved.rglob("*") if p.is_file()
        } == files
    warnings = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    for name in damaged:
        assert name in warnings
    assert "not valid JSON" in warnings and "manifest.json is missing" in warnings
    assert "has 9 bytes" in warnings and "no manifest.json" in warnings
    shutil.rmtree(storage)
