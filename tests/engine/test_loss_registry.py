"""Loss parameters are parsed once into a typed union, and what each loss needs is declared once
(`trainer.contract.specs.LOSS_SPECS`): the API's 400, the engine's INVALID_INPUT and `compute_loss`
all
read the registry, so a rule added there is enforced at every layer."""

from __future__ import annotations

import ast
import dataclasses
import math
from pathlib import Path

import pytest
import torch

from tests.engine.helpers import grads_of, make_resource, random_batch
from trainer.compute.batch import LossNorm
from trainer.compute.losses import LossInputs, compute_loss
from trainer.contract.errors import OperationError
from trainer.contract.specs import (
    LOSS_SPECS,
    DroParams,
    GrpoParams,
    InputRule,
    LossConfig,
    ModelEntry,
    PpoParams,
    SessionSpec,
)
from trainer.serving.errors import ApiError
from trainer.serving.requests import ForwardBackwardBody, check_forward_backward

TRAINER = Path(__file__).resolve().parents[2] / "trainer"
ENTRY = ModelEntry(name="tiny", location="unused", max_seq_length=256, max_batch_size=512)


def _inputs(n: int = 6, **missing: None) -> LossInputs:
    gen = torch.Generator().manual_seed(0)
    fields = {
        "logprobs_P": -torch.rand(n, generator=gen) - 0.1,
        "sample_index_P": torch.zeros(n, dtype=torch.int64),
        "num_samples": 1,
        "mask_P": torch.ones(n),
        "norm": LossNorm(float(n), 1, n),
        "sampler_logprobs_P": -torch.rand(n, generator=gen) - 0.1,
        "advantages_P": torch.randn(n, generator=gen),
        "reference_logprobs_P": -torch.rand(n, generator=gen) - 0.1,
    }
    return LossInputs(**{**fields, **missing})  # type: ignore[arg-type]


def test_params_are_parsed_once_into_the_typed_union() -> None:
    wire = {"type": "grpo", "grpo_params": {"beta": 0.25}, "ppo_params": {"clip_low_threshold": 9}}
    loss = LossConfig.model_validate(wire)
    params = loss.params()
    assert isinstance(params, GrpoParams) and params.beta == 0.25
    assert loss.params() is params  # not parsed again
    assert loss.spec is LOSS_SPECS["LOSS_TYPE_GRPO"]
    # the wire shape is unchanged (type + the six <x>_params; the others dropped unread)
    dumped = loss.model_dump(mode="json")
    assert set(dumped) == {
        "type",
        "cross_entropy_params",
        "grpo_params",
        "ppo_params",
        "cispo_params",
        "dppo_params",
        "dro_params",
    }
    again = LossConfig.model_validate(dumped)  # the rank-0 proxy's round trip
    assert again.params() == params
    assert isinstance(LossConfig(type="ppo").params(), PpoParams)
    # a param without a default is required, with the same message as before
    with pytest.raises(ValueError, match=r"loss\.dro_params\.beta is required for LOSS_TYPE_DRO"):
        LossConfig(type="dro", dro_params={"beta": None})
    assert LossConfig(type="dro", dro_params={"beta": 0.5}).params() == DroParams(beta=0.5)


def test_required_inputs_come_from_the_registry() -> None:
    assert LOSS_SPECS["LOSS_TYPE_CROSS_ENTROPY"].weights_are_mask is False
    assert all(s.weights_are_mask for k, s in LOSS_SPECS.items() if "CROSS" not in k)
    grpo = LOSS_SPECS["LOSS_TYPE_GRPO"]
    assert grpo.required_for(GrpoParams()) == ("logprobs", "advantages")
    assert grpo.required_for(GrpoParams(beta=0.1)) == (
        "logprobs",
        "advantages",
        "reference_logprobs",
    )


def _rule_on_dro(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new rule, declared once: DRO with β > 0.5 needs reference logprobs."""
    rule = InputRule("reference_logprobs", "when dro_params.beta > 0.5", lambda p: p.beta > 0.5)
    spec = dataclasses.replace(LOSS_SPECS["LOSS_TYPE_DRO"], rules=(rule,))
    monkeypatch.setitem(LOSS_SPECS, "LOSS_TYPE_DRO", spec)


def test_a_rule_declared_once_is_enforced_by_the_api_and_compute_loss(monkeypatch) -> None:
    _rule_on_dro(monkeypatch)
    strict = LossConfig(type="dro", dro_params={"beta": 0.7})
    lenient = LossConfig(type="dro", dro_params={"beta": 0.3})
    samples = random_batch(5, n=300, logprobs="logprobs", advantages="normal")
    samples[-1] = random_batch(6, n=1, logprobs="logprobs", advantages="normal")[0]
    for s in samples[:-1]:
        s.loss_fn_inputs["reference_logprobs"] = s.loss_fn_inputs["logprobs"]
    check_forward_backward(ForwardBackwardBody(loss=lenient, samples=samples), ENTRY)
    with pytest.raises(ApiError) as info:
        check_forward_backward(ForwardBackwardBody(loss=strict, samples=samples), ENTRY)
    assert info.value.param == "samples[299].loss_fn_inputs.reference_logprobs"
    assert "required by loss LOSS_TYPE_DRO" in str(info.value)

    with pytest.raises(ValueError, match=r"reference_logprobs is required when dro_params\.beta"):
        compute_loss("LOSS_TYPE_DRO", _inputs(reference_logprobs_P=None), strict.params())
    out = compute_loss("LOSS_TYPE_DRO", _inputs(reference_logprobs_P=None), lenient.params())
    assert math.isfinite(float(out.loss))


def test_a_rule_declared_once_is_enforced_by_the_engine(monkeypatch, tiny_qwen_dir, tmp_path):
    _rule_on_dro(monkeypatch)
    resource = make_resource(tiny_qwen_dir, tmp_path)
    session = resource.create_session("a", SessionSpec())
    samples = random_batch(3, n=64, logprobs="logprobs", advantages="normal")
    for s in samples[:40]:
        s.loss_fn_inputs["reference_logprobs"] = s.loss_fn_inputs["logprobs"]
    before = grads_of(session)
    with pytest.raises(OperationError) as info:
        session.forward_backward(LossConfig(type="dro", dro_params={"beta": 0.7}), samples)
    assert info.value.code == "INVALID_INPUT"
    assert info.value.message.startswith("samples[40].loss_fn_inputs.reference_logprobs")
    assert "is required when dro_params.beta > 0.5" in info.value.message
    assert grads_of(session).keys() == before.keys()
    assert all(g is None for g in grads_of(session).values())  # no trace
    session.forward_backward(LossConfig(type="dro", dro_params={"beta": 0.3}), samples)
    assert any(g is not None for g in grads_of(session).values())


def _loss_type_compares(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for sub in ast.walk(node):
                if isinstance(sub, ast.Constant) and str(sub.value).startswith("LOSS_TYPE_"):
                    lines.append(node.lineno)
    return lines


def test_no_loss_type_is_compared_as_a_string() -> None:
    found = {
        str(path.relative_to(TRAINER)): lines
        for path in sorted(TRAINER.rglob("*.py"))
        if (lines := _loss_type_compares(ast.parse(path.read_text())))
    }
    assert found == {}


def test_batch_does_not_import_losses() -> None:
    tree = ast.parse((TRAINER / "compute" / "batch.py").read_text())
    imported = {
        node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
    }
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "trainer.compute.losses" not in imported
    assert LossNorm.__module__ == "trainer.compute.batch"
