"""Checkpoint writes: fsync and sha256 overlapped, the manifest unchanged."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from trainer.checkpoints import TRAINING, CheckpointStore, seal_files, sha256_file


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"a": torch.randn(1000, 37, generator=gen), "b": torch.arange(10)}


def test_seal_files_hashes_match_a_fresh_read(tmp_path: Path) -> None:
    save_file(_tensors(), str(tmp_path / "w.safetensors"))
    (tmp_path / "plain.bin").write_bytes(b"x" * 3_000_001)
    (tmp_path / "empty").write_bytes(b"")
    paths = sorted(tmp_path.iterdir())
    digests = seal_files(paths)
    for path in paths:
        assert digests[path] == hashlib.sha256(path.read_bytes()).hexdigest() == sha256_file(path)


def test_store_manifest_hashes_every_file(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "store")

    def writer(out: Path) -> None:
        save_file(_tensors(), str(out / "weights.safetensors"))
        (out / "sub").mkdir()
        (out / "sub" / "state.json").write_text("{}")

    record = store.write(
        type=TRAINING, session_id="s", step=1, base_model="m", lora_rank=None, writer=writer
    )
    manifest = json.loads((record.path / "manifest.json").read_text())
    for rel, info in manifest["files"].items():
        data = (record.path / rel).read_bytes()
        assert info == {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    store.open(record.id)  # verifies every hash
    store.close()
