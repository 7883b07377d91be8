"""Checkpoint writes: safetensors from tensor memory, fsync and sha256 overlapped with the
writing, the manifest unchanged."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.engine.helpers import make_resource, random_batch
from trainer.checkpoint.files import _DTYPES
from trainer.checkpoint.store import (
    TRAINING,
    CheckpointStore,
    save_tensors,
    seal_files,
    sha256_file,
)


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


# -- save_tensors: safetensors from tensor memory, sealed while the writer goes on ------------


def _every_dtype() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(6, 5, generator=gen) * 50
    out = {f"t_{str(d).removeprefix('torch.')}": base.to(d) for d in _DTYPES}
    out.update(
        scalar=torch.tensor(3.5),
        empty=torch.zeros(0, 4),
        strided=torch.randn(7, 9, generator=gen).t(),  # not contiguous
        **{"ünïcode name": torch.arange(5)},
    )
    return out


@pytest.mark.parametrize("metadata", [None, {"format": "pt"}])
def test_save_tensors_is_byte_identical_to_safetensors(tmp_path: Path, metadata) -> None:
    tensors = _every_dtype()
    save_tensors(tensors, tmp_path / "ours.safetensors", metadata)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, tmp_path / "ref.safetensors", metadata
    )
    ours = (tmp_path / "ours.safetensors").read_bytes()
    assert ours == (tmp_path / "ref.safetensors").read_bytes()
    loaded = load_file(tmp_path / "ours.safetensors")
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape
        assert (
            loaded[name]
            .view(-1)
            .view(torch.uint8)
            .equal(tensor.contiguous().view(-1).view(torch.uint8))
        )


def test_concurrent_checkpoint_writes_keep_their_own_hashes(tmp_path: Path) -> None:
    """Four writers at once, each with 24 MB of tensors handed to its own sealer while it
    writes (the sealer is per checkpoint, per thread): every manifest matches its own bytes."""
    store = CheckpointStore(tmp_path / "store")

    def one(seed: int) -> Any:
        gen = torch.Generator().manual_seed(seed)
        big = {"a": torch.randn(3 << 20, generator=gen), "b": torch.randn(3 << 20, generator=gen)}

        def writer(out: Path) -> None:
            save_tensors(big, out / "optimizer.safetensors")
            save_tensors({"w": big["a"][:1000] * 2}, out / "weights.safetensors")
            (out / "state.json").write_text(json.dumps({"seed": seed}))

        return store.write(
            type=TRAINING, session_id=f"s{seed}", step=seed, base_model="m", lora_rank=None,
            writer=writer,
        )  # fmt: skip

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        records = list(pool.map(one, range(4)))
    for seed, record in enumerate(records):
        manifest = json.loads((record.path / "manifest.json").read_text())
        assert set(manifest["files"]) == {
            "optimizer.safetensors",
            "weights.safetensors",
            "state.json",
        }
        for rel, info in manifest["files"].items():
            data = (record.path / rel).read_bytes()
            assert info == {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
        assert json.loads((record.path / "state.json").read_text()) == {"seed": seed}
        store.open(record.id)
    store.close()


def test_a_file_rewritten_after_hand_off_is_hashed_again(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "store")

    def writer(out: Path) -> None:
        save_tensors({"x": torch.zeros(1000)}, out / "w.safetensors")  # handed to the sealer
        save_tensors({"x": torch.ones(1000)}, out / "w.safetensors")  # same size, new bytes

    record = store.write(
        type=TRAINING, session_id="s", step=0, base_model="m", lora_rank=None, writer=writer
    )
    data = (record.path / "w.safetensors").read_bytes()
    manifest = json.loads((record.path / "manifest.json").read_text())
    assert manifest["files"]["w.safetensors"]["sha256"] == hashlib.sha256(data).hexdigest()
    assert load_file(record.path / "w.safetensors")["x"].equal(torch.ones(1000))
    store.close()


def test_training_checkpoint_files_are_the_live_state(tiny_qwen_dir: Path, tmp_path: Path) -> None:
    """Written from the live tensors under the lock (no copy-out): safetensors' own loader reads
    back exactly the weights and AdamW moments of the session."""
    from trainer.contract.specs import AdamParams, LossConfig, SessionSpec

    resource = make_resource(tiny_qwen_dir, tmp_path, lora=False)
    session = resource.create_session("s", SessionSpec())
    session.forward_backward(
        LossConfig(type="LOSS_TYPE_CROSS_ENTROPY"), random_batch(0, weights="ones")
    )
    session.optim_step(AdamParams(learning_rate=1e-2))
    record = session.save_training_checkpoint()
    weights = load_file(record.path / "weights.safetensors")
    optimizer = load_file(record.path / "optimizer.safetensors")
    assert set(weights) == set(session.policy.trainable)
    for name, param in session.policy.trainable.items():
        assert weights[name].equal(param.detach())
        for key, value in session.optimizer.state[param].items():
            assert optimizer[f"{name}::{key}"].equal(value)
    resource.store.close()
