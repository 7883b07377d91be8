"""Muon under two CPU ranks (gloo) equals one process (docs/semantics.md §10), LoRA and full
weights:
under FSDP2 each full-weight matrix's update is gathered for Newton–Schulz and each rank
keeps its shard; LoRA adapters are replicated. Losses, gradient norms, and the weights and
optimizer state (Muon momentum buffers, AdamW moments) of the final training checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.launch import two_rank_case
from tests.distributed.muon_scenario import drive_muon, muon_resource_spec
from tests.distributed.scenario import OPTIONS, entry
from tests.distributed.test_sharded import _close, states_close
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
    two = two_rank_case("muon", tiny_qwen_dir, storage, work)
    return storage, one, two


@pytest.mark.parametrize("kind", KINDS)
def test_two_ranks_equal_one_process(muon_runs, kind: str) -> None:
    storage, one, two = muon_runs
    for a_step, b_step in zip(one[kind]["steps"], two[kind]["steps"], strict=True):
        assert all(_close(a, b) for a, b in zip(a_step, b_step, strict=True)), (one, two)
    a = states_close(storage, one[kind]["training"], two[kind]["training"])
    assert any(k.endswith("::momentum_buffer") for k in a)
