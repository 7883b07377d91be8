"""Embedding calls under two CPU ranks (gloo) equal one process (docs/semantics.md §27), LoRA
and full weights: each rank pools its share of the texts and the vectors meet by one
all-reduce, so the outputs (vectors by mean and last pooling, cosine rows) are one process's;
an InfoNCE backward and an `embedding` backward of fixed gradients, two AdamW steps, give one
process's losses and gradient norms, and the final training checkpoint its weights and
optimizer state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.distributed.embed_scenario import drive_embed
from tests.distributed.launch import two_rank_case
from tests.distributed.scenario import OPTIONS, entry, resource_spec
from tests.distributed.test_sharded import _close, states_close
from trainer.checkpoint.store import CheckpointStore
from trainer.engine.resource import ModelResource

pytestmark = pytest.mark.distributed

KINDS = ("full", "lora")


@pytest.fixture(scope="module")
def embed_runs(tiny_qwen_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("embed-dist")
    storage = work / "storage"
    store = CheckpointStore(storage)
    width = json.loads((tiny_qwen_dir / "config.json").read_text())["hidden_size"]
    one = {}
    for kind in KINDS:
        resource = ModelResource(
            entry(str(tiny_qwen_dir)), resource_spec(kind), store, device="cpu", options=OPTIONS
        )
        one[kind] = drive_embed(resource, kind, width)
        resource.close()
    store.close()
    two = two_rank_case("embed", tiny_qwen_dir, storage, work, "--width", str(width))
    return storage, one, two


@pytest.mark.parametrize("kind", KINDS)
def test_two_ranks_embed_and_train_like_one_process(embed_runs, kind: str) -> None:
    storage, one, two = embed_runs
    for a, b in zip(one[kind]["forward"], two[kind]["forward"], strict=True):
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), atol=1e-5, rtol=1e-5)
    for a_step, b_step in zip(one[kind]["steps"], two[kind]["steps"], strict=True):
        assert all(_close(a, b) for a, b in zip(a_step, b_step, strict=True)), (one, two)
    assert _close(one[kind]["after"], two[kind]["after"]), (one[kind], two[kind])
    assert one[kind]["after"] != one[kind]["steps"][0][0]  # the steps moved the weights
    state = states_close(storage, one[kind]["training"], two[kind]["training"])
    # the head's adapter, which no embedding call reaches, has no optimizer state on either
    head = [k for k in state if "lm_head" in k]
    assert (kind == "lora") == bool(head) and not [k for k in head if "::" in k], head
