"""Muon under two CPU ranks (gloo) equals one process (docs/semantics.md §10), LoRA and full
weights:
under FSDP2 each full-weight matrix's update is gathered for Newton–Schulz and each rank
keeps its shard; LoRA adapters are replicated. Losses, gradient norms, and the weights and
optimizer state (Muon momentum buffers, AdamW moments) of the final training checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.launch import run_ranks
from tests.distributed.muon_scenario import drive_muon, muon_resource_spec
from tests.distributed.scenario import OPTIONS, entry
from tests.distributed.test_sharded import _checkpoint, _close
from trainer.checkpoint.store import CheckpointStore
from trainer.engine.resource import ModelResource

pytestmark = pytest.mark.distributed

KINDS = ("full", "lora")
STRATEGY = "MUON_SCALING_STRATEGY_ORIGINAL"


@pytest.fixture(scope="module")
def muon_runs(tiny_qwen_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("muon-dist")
    storage = work / "storage"
    store = CheckpointStore(storage)
    one = {}
    for kind in KINDS:
        resource = ModelResource(
            entry(str(tiny_qwen_dir)),
            muon_resource_spec(kind, STRATEGY),
            store,
            device="cpu",
            options=OPTIONS,
        )
        one[kind] = drive_muon(resource, kind)
        resource.close()
    store.close()
    ranks = run_ranks(
        [
            *("muon", "--model-dir", str(tiny_qwen_dir), "--storage", str(storage)),
            *("--out", str(work / "two.json")),
        ],
        world_size=2,
        log_dir=work,
        timeout_s=300.0,
        env={"TRAINER_DIST_TIMEOUT_S": "60"},
    )
    for rank in ranks:
        assert rank.returncode == 0, f"rank {rank.rank} exited {rank.returncode}:\n{rank.log}"
    return storage, one, json.loads((work / "two.json").read_text())


@pytest.mark.parametrize("kind", KINDS)
def test_two_ranks_equal_one_process(muon_runs, kind: str) -> None:
    storage, one, two = muon_runs
    for a_step, b_step in zip(one[kind]["steps"], two[kind]["steps"], strict=True):
        assert all(_close(a, b) for a, b in zip(a_step, b_step, strict=True)), (one, two)
    a = _checkpoint(storage, one[kind]["training"])
    b = _checkpoint(storage, two[kind]["training"])
    assert a.keys() == b.keys()
    assert any(k.endswith("::momentum_buffer") for k in a)
    for key in a:
        error = float((a[key].double() - b[key].double()).norm())
        assert error <= 1e-4 * max(float(a[key].double().norm()), 1e-6), key
