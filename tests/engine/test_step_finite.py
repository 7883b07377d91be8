"""An optim-step whose update would leave a weight or an optimizer state tensor non-finite
fails with NON_FINITE_LOSS and changes nothing (weights, gradients, optimizer state, step);
learning rates above `MAX_LEARNING_RATE` are refused by the contract, on either optimizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from tests.engine.helpers import random_batch
from trainer.checkpoint.store import CheckpointStore
from trainer.contract.errors import OperationError
from trainer.contract.muon_params import MuonParams
from trainer.contract.optimizer import MAX_LEARNING_RATE
from trainer.contract.specs import (
    AdamParams,
    LoraConfig,
    LossConfig,
    ModelEntry,
    ResourceSpec,
    SessionSpec,
)
from trainer.engine.resource import ModelResource
from trainer.engine.session import TrainingSession

CE = LossConfig(type="cross_entropy")


def _session(model_dir: Path, storage: Path, muon: bool) -> TrainingSession:
    entry = ModelEntry(name="tiny", location=str(model_dir), max_seq_length=256)
    config: dict[str, Any] = {"muon": {}} if muon else {"adam": {}}
    spec = ResourceSpec(base_model="tiny", lora_enabled=True, optimizer_config=config)
    resource = ModelResource(entry, spec, CheckpointStore(storage), device="cpu")
    return resource.create_session("s", SessionSpec(lora_config=LoraConfig(rank=8, seed=1)))


def _snapshot(session: TrainingSession) -> dict[str, torch.Tensor]:
    out = {}
    for name, param in session.policy.trainable.items():
        out[f"w:{name}"] = param.detach().clone()
        if param.grad is not None:
            out[f"g:{name}"] = param.grad.detach().clone()
        for slot, value in session.optimizer.state.get(param, {}).items():
            out[f"s:{name}:{slot}"] = value.detach().clone()
    return out


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("muon", [False, True], ids=["adamw", "muon"])
def test_a_non_finite_update_fails_the_step_and_changes_nothing(
    tiny_qwen_dir: Path, tmp_path: Path, muon: bool
) -> None:
    """A good step first (the optimizer state exists), then gradients, then a step whose
    weight decay overflows every weight: NON_FINITE_LOSS, and the weights, gradients, optimizer
    state and counters are bit for bit what they were; the next sane step runs on them."""
    session = _session(tiny_qwen_dir, tmp_path, muon)
    session.forward_backward(CE, random_batch(0, n=8, lengths=(6, 40), weights="ones"))
    sane = MuonParams(learning_rate=0.01) if muon else AdamParams(learning_rate=0.01)
    hostile = sane.model_copy(update={"learning_rate": MAX_LEARNING_RATE, "weight_decay": 1e300})
    session.optim_step(**{("muon" if muon else "adam"): sane})
    session.forward_backward(CE, random_batch(1, n=8, lengths=(6, 40), weights="ones"))
    before, step = _snapshot(session), session.step
    with pytest.raises(OperationError) as caught:
        session.optim_step(**{("muon" if muon else "adam"): hostile})
    assert caught.value.code == "NON_FINITE_LOSS"
    _assert_same(_snapshot(session), before)
    assert session.step == step and session.versions.trainer_step == step
    session.optim_step(**{("muon" if muon else "adam"): sane})
    assert session.step == step + 1
    assert all(torch.isfinite(p).all() for p in session.policy.trainable.values())


@pytest.mark.parametrize("params", [AdamParams, MuonParams])
def test_absurd_learning_rates_are_refused(params: type) -> None:
    params(learning_rate=MAX_LEARNING_RATE)
    for rate in (1e30, MAX_LEARNING_RATE * 1.01):
        with pytest.raises(ValidationError, match="learning_rate"):
            params(learning_rate=rate)
    with pytest.raises(ValidationError, match="learning_rate"):
        MuonParams(adam={"learning_rate": 1e30})
