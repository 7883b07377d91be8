"""The Firetitan data plane's pure pieces (docs/semantics.md §23), CPU, no server: the
normalized optimizer step against `torch.optim.AdamW`, the accumulation counts, the model
plans a `Binding` allows, logical checkpoint names, forward-only inputs and an old store."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from trainer.api.tinker import convert, models, names
from trainer.api.tinker.binding import Binding
from trainer.api.tinker.convert_inputs import TinkerInputError
from trainer.api.tinker.records import TinkerModel, TinkerRecords
from trainer.api.tinker.requests import CreateModel
from trainer.compute import optim
from trainer.compute.batch import PreparedSample
from trainer.compute.placement import Solo
from trainer.contract.errors import OperationError
from trainer.contract.specs import AdamParams, ModelEntry
from trainer.engine.session import TrainingSession
from trainer.serving.errors import ApiError
from trainer.serving.tenants import Principal

ENTRY = ModelEntry(name="accounts/fireworks/models/tiny", location="unused", max_lora_rank=16)


def _params(seed: int) -> list[nn.Parameter]:
    torch.manual_seed(seed)
    return [nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(5))]


def test_a_normalized_step_is_adamw_on_the_divided_gradient() -> None:
    ours, ref = _params(0), _params(0)
    for p, q in zip(ours, ref, strict=True):
        p.grad = torch.full_like(p, 3.0) * torch.arange(p.numel()).view_as(p)
        q.grad = p.grad.clone() * (1 / 7)  # the engine multiplies by 1/N
    adam = AdamParams(learning_rate=0.1, beta1=0.9, beta2=0.95, eps=1e-8, grad_clip_norm=0.0)
    opt = optim.new_adamw(ours)
    metrics = optim.adamw_step(opt, ours, adam, Solo(), grad_scale=1 / 7)
    torch_opt = torch.optim.AdamW(ref, lr=0.1, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    expected_norm = float(torch.nn.utils.get_total_norm([q.grad for q in ref]))
    torch_opt.step()
    for p, q in zip(ours, ref, strict=True):
        assert torch.equal(p.detach(), q.detach())
    assert metrics["grad_norm"] == pytest.approx(expected_norm, rel=1e-6)


def test_a_refused_step_leaves_the_gradients_unscaled() -> None:
    params = _params(1)
    for p in params:
        p.grad = torch.ones_like(p)
    params[0].grad[0, 0] = float("nan")
    before = [p.grad.clone() for p in params]
    with pytest.raises(OperationError, match="gradient norm is nan"):
        optim.adamw_step(optim.new_adamw(params), params, AdamParams(), Solo(), 0.5)
    for p, g in zip(params, before, strict=True):
        assert torch.equal(p.grad.nan_to_num(), g.nan_to_num())


def _sample(mask: list[float]) -> PreparedSample:
    n = len(mask)
    return PreparedSample(0, torch.zeros(n, dtype=torch.long), torch.zeros(n), torch.tensor(mask))


def test_the_accumulated_counts_and_their_scale() -> None:
    session: Any = SimpleNamespace(
        policy=SimpleNamespace(trainable={}),
        optimizer=None,  # one that keeps no fp32 sums
        accumulated_tokens=0,
        accumulated_sequences=0,
    )
    TrainingSession.keep_grads(session, {}, [_sample([1, 1, 0]), _sample([0, 0])])
    TrainingSession.keep_grads(session, {}, [_sample([1, 1, 1, 1])])
    assert (session.accumulated_tokens, session.accumulated_sequences) == (6, 2)
    assert TrainingSession.grad_scale(session, "num_loss_tokens") == 1 / 6
    assert TrainingSession.grad_scale(session, "num_sequences") == 1 / 2
    assert TrainingSession.grad_scale(session, None) == 1.0
    empty: Any = SimpleNamespace(accumulated_tokens=0, accumulated_sequences=0)
    assert TrainingSession.grad_scale(empty, "num_loss_tokens") == 1.0


def test_grad_accumulation_normalization_values() -> None:
    assert convert.grad_normalization({}) is None
    assert convert.grad_normalization({"grad_accumulation_normalization": "NONE"}) is None
    assert convert.grad_normalization({"grad_accumulation_normalization": "num_sequences"}) == (
        "num_sequences"
    )
    with pytest.raises(TinkerInputError, match="grad_accumulation_normalization"):
        convert.grad_normalization({"grad_accumulation_normalization": "mean"})
    body = {"adam_params": {"learning_rate": 1e-3, "emit_grad_norm_metrics": "basic"}}
    assert convert.optim_step_body(body)["adam_params"]["learning_rate"] == 1e-3


def _binding(rank: int, forward_only: bool = False) -> Binding:
    return Binding("acct", "job-1", "res_1", ENTRY.name, rank, forward_only)


def _create(**body: Any) -> CreateModel:
    return CreateModel.model_validate(
        {"session_id": "s", "model_seq_id": 0, "base_model": ENTRY.name, **body}
    )


def test_model_plans_under_a_binding() -> None:
    assert models.plan(_create(lora_config={"rank": 0}), ENTRY, None).kind == "full"
    lora = models.plan(_create(lora_config={"rank": 4, "alpha": 8}), ENTRY, None)
    assert lora.lora_config is not None and lora.lora_config["alpha"] == 8 and lora.rank == 4
    base = models.plan(_create(base_only=True), ENTRY, None)
    assert (base.kind, base.frozen, base.rank) == ("base", True, 0)
    assert models.plan(_create(lora_config={"rank": 8}), ENTRY, _binding(8)).rank == 8
    assert models.plan(_create(), ENTRY, _binding(0)).kind == "full"
    assert models.plan(_create(lora_config={"rank": 2}), ENTRY, _binding(8, True)).frozen
    for body, binding in (
        ({"lora_config": {"rank": 9}}, _binding(8)),
        ({"lora_config": {"rank": 2}}, _binding(0)),
        ({"lora_config": {"rank": 0}}, _binding(8)),
    ):
        with pytest.raises(ApiError) as err:
            models.plan(_create(**body), ENTRY, binding)
        assert err.value.param == "lora_config.rank", err.value.message


def test_logical_names() -> None:
    scope = _binding(8).scope
    path = names.canonical("acct", scope, "step-4")
    assert names.canonical_of("step-4", "path", "acct", scope) == path
    assert names.canonical_of("cross_job://job-1/step-4", "path", "acct", None) == path
    assert names.canonical_of(path, "path", "acct", None) == path
    with pytest.raises(ApiError) as other:
        names.canonical_of(path, "path", "zed", None)
    with pytest.raises(ApiError) as missing:
        names.canonical_of("step-4", "path", "zed", None)
    assert other.value.param == missing.value.param == "path"
    with pytest.raises(ApiError, match="not a checkpoint reference"):
        names.canonical_of("a/b", "path", "acct", scope)
    assert names.account_of(Principal("Alice_1"), None).startswith("u-")
    assert names.account_of(Principal("bob"), None) == "bob"


def test_forward_only_ignores_inputs_the_loss_does_not_read() -> None:
    datum = {
        "model_input": {"chunks": [{"tokens": [1, 2, 3]}]},
        "loss_fn_inputs": {
            "target_tokens": {"data": [2, 3, 4], "dtype": "int64"},
            "loss_mask": {"data": [1.0, 1.0, 1.0], "dtype": "float32"},
        },
    }
    fbi = {"data": [datum], "loss_fn": "cross_entropy"}
    body = convert.forward_backward_body(fbi, True)
    assert set(body["samples"][0]["loss_fn_inputs"]) == {"target_tokens", "weights"}
    with pytest.raises(TinkerInputError, match="loss_mask"):
        convert.forward_backward_body(fbi, False)
    with pytest.raises(TinkerInputError, match="served"):
        convert.forward_backward_body({**fbi, "loss_fn": "dapo"}, True)
    dppo = {**fbi, "loss_fn": "dppo"}
    datum_pg = {
        **datum,
        "loss_fn_inputs": {
            "target_tokens": {"data": [2, 3, 4], "dtype": "int64"},
            "logprobs": {"data": [-1.0] * 3, "dtype": "float32"},
            "advantages": {"data": [1.0] * 3, "dtype": "float32"},
        },
    }
    out = convert.forward_backward_body({**dppo, "data": [datum_pg]}, False)
    assert out["loss"]["type"] == "LOSS_TYPE_DPPO"


def test_an_old_store_loads_with_models_unfrozen(tmp_path: Path) -> None:
    path = tmp_path / "tinker.sqlite"
    db = sqlite3.connect(path)
    db.execute(
        "CREATE TABLE models (id TEXT PRIMARY KEY, tinker_session TEXT, base_model TEXT, "
        "session_id TEXT, resource_id TEXT, lora_rank INTEGER, created_at REAL, "
        "last_request_at REAL, lora_config TEXT, user_metadata TEXT)"
    )
    db.execute("INSERT INTO models VALUES ('m', 's', 'b', 'ts', 'r', 2, 1.0, 1.0, '{}', '{}')")
    db.commit()
    db.close()
    records = TinkerRecords(path)
    model = records.get(TinkerModel, "m")
    assert model is not None and model.frozen is False and model.scope is None
    records.update(TinkerModel, "m", frozen=True)
    again = records.get(TinkerModel, "m")
    assert again is not None and again.frozen is True
