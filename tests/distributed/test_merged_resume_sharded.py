"""Full weights from a LoRA sampler checkpoint under two CPU ranks (how a promoted `merged_base`
model deploys under torchrun, docs/semantics.md §16): the sharded session serves the
checkpoint's merged files, as one process does; a checkpoint whose adapter trained the head of a
tied model, which the sharded resource cannot untie, is refused on every rank alike, naming the
field, and the group goes on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.distributed.launch import two_rank_case
from tests.distributed.scenario import OPTIONS, entry, resource_spec
from tests.engine.helpers import random_batch
from trainer.checkpoint.store import CheckpointStore
from trainer.contract.specs import AdamParams, LoraConfig, LossConfig, SessionSpec
from trainer.engine.resource import ModelResource

pytestmark = pytest.mark.distributed

CE = LossConfig(type="cross_entropy")


def _forward(session) -> list[list[float]]:
    out = session.forward_backward(
        CE, random_batch(11, n=3, weights="ones"), forward_only=True, return_loss_fn_outputs=True
    )
    return [list(o["tensors"]["logprobs"]["data"]) for o in out["loss_fn_outputs"]]


def test_two_ranks_serve_a_lora_checkpoints_merged_files(
    tiny_qwen_dir: Path, tmp_path: Path
) -> None:
    storage = tmp_path / "storage"
    store = CheckpointStore(storage)
    lora = ModelResource(
        entry(str(tiny_qwen_dir)), resource_spec("lora"), store, device="cpu", options=OPTIONS
    )
    ids = {}
    for name, head in (("plain", False), ("head", True)):
        config = LoraConfig(rank=4, seed=1, train_unembed=head)
        session = lora.create_session(name, SessionSpec(lora_config=config))
        session.forward_backward(CE, random_batch(5, n=3, weights="ones"))
        session.optim_step(AdamParams(learning_rate=5e-2))
        ids[name] = session.save_inference_checkpoint().id
    lora.close()
    full = ModelResource(
        entry(str(tiny_qwen_dir)), resource_spec("full"), store, device="cpu", options=OPTIONS
    )
    one = _forward(full.create_session("one", SessionSpec(resume_from_checkpoint_id=ids["plain"])))
    full.close()
    store.close()

    two = two_rank_case(
        "merged_resume", tiny_qwen_dir, storage, tmp_path, "--reference", json.dumps(ids)
    )
    refused = two["refused"]
    assert refused is not None and refused["code"] == "INVALID_INPUT", two
    assert refused["message"].startswith("resume_from_checkpoint_id"), refused
    assert "more than one rank" in refused["message"], refused
    for got, want in zip(two["logprobs"], one, strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=1e-5)
