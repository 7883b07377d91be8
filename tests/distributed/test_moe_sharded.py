"""Muon on a tiny Qwen3-MoE under two CPU ranks (gloo) equals one process (docs/semantics.md §10):
full weights under FSDP2 (each fused 3-D expert stack gathered, orthogonalised expert by
expert, each rank keeping its shard) and LoRA with per-expert factors on the fused stacks
(replicated). Losses, gradient norms, and the final training checkpoint's weights and
optimizer state, as `test_muon_sharded` checks for dense models."""

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
def moe_runs(tiny_moe_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("moe-dist")
    storage = work / "storage"
    store = CheckpointStore(storage)
    one = {}
    for kind in KINDS:
        resource = ModelResource(
            entry(str(tiny_moe_dir)),
            muon_resource_spec(kind, STRATEGY),
            store,
            device="cpu",
            options=OPTIONS,
        )
        one[kind] = drive_muon(resource, kind)
        resource.close()
    store.close()
    two = two_rank_case("muon", tiny_moe_dir, storage, work)
    return storage, one, two


@pytest.mark.parametrize("kind", KINDS)
def test_moe_two_ranks_equal_one_process(moe_runs, kind: str) -> None:
    storage, one, two = moe_runs
    for a_step, b_step in zip(one[kind]["steps"], two[kind]["steps"], strict=True):
        assert all(_close(a, b) for a, b in zip(a_step, b_step, strict=True)), (one, two)
    a = states_close(storage, one[kind]["training"], two[kind]["training"])
    experts = [k for k in a if ".mlp.experts." in k and k.endswith("::momentum_buffer")]
    assert experts, "the expert tensors are Muon's"
