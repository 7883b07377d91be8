"""Loss parameters are parsed once into a typed union, and what each loss needs is declared once
(`trainer.contract.specs.LOSS_SPECS`): the API's 400, the engine's INVALID_INPUT and `compute_loss`
all
read the registry, so a rule added there is enforced at every layer. Every other table of losses
or inputs is derived from the registry or checked against it here, and no module outside it
spells a table of loss inputs."""

from __future__ import annotations

import ast
import dataclasses
import math
from pathlib import Path

import pytest
import torch

from tests.engine.helpers import grads_of, make_resource, random_batch, sample
from trainer.api.tinker import convert
from trainer.compute import batch
from trainer.compute.batch import LossNorm, prepare_samples
from trainer.compute.losses import INPUT_FIELDS, LOSSES, LossInputs, compute_loss
from trainer.contract.errors import OperationError
from trainer.contract.losses import FLOAT_INPUTS, LOSS_INPUTS, TOKEN_INPUTS, LossType
from trainer.contract.specs import (
    LOSS_SPECS,
    DroParams,
    GrpoParams,
    ImportanceSamplingParams,
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
    # the wire shape: type + the six <x>_params of the RL face, the Tinker face's
    # stable_reinforce_params and importance_sampling_params (the others dropped unread)
    dumped = loss.model_dump(mode="json")
    assert set(dumped) == {
        "type",
        "cross_entropy_params",
        "grpo_params",
        "ppo_params",
        "cispo_params",
        "dppo_params",
        "dro_params",
        "stable_reinforce_params",
        "importance_sampling_params",
    }
    again = LossConfig.model_validate(dumped)  # the rank-0 proxy's round trip
    assert again.params() == params
    capped = LossConfig.model_validate(
        {"type": "importance_sampling", "importance_sampling_params": {"ratio_log_cap": 2.0}}
    )
    relayed = LossConfig.model_validate(capped.model_dump(mode="json"))
    assert relayed.params() == ImportanceSamplingParams(ratio_log_cap=2.0)
    assert isinstance(LossConfig(type="ppo").params(), PpoParams)
    # a param without a default is required, with the message that names it
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


def test_every_loss_table_agrees_with_the_registry() -> None:
    wire = set(LOSS_SPECS)
    assert set(LossType.__args__) == wire | {"LOSS_TYPE_UNSPECIFIED"}  # type: ignore[attr-defined]
    assert set(LOSSES) == wire
    params_fields = set(LossConfig.model_fields) - {"type"}
    for spec in LOSS_SPECS.values():  # a loss with knobs has its `<x>_params` on the wire
        assert spec.params_key in params_fields or not spec.params_cls.model_fields
    assert params_fields <= {spec.params_key for spec in LOSS_SPECS.values()}
    named = {
        name
        for spec in LOSS_SPECS.values()
        for name in (*spec.required, *spec.optional, *(rule.input for rule in spec.rules))
    }
    assert named <= set(INPUT_FIELDS)  # every input a loss names reaches its function
    assert {n: i.field for n, i in LOSS_INPUTS.items() if i.field is not None} == INPUT_FIELDS
    assert set(INPUT_FIELDS.values()) <= {f.name for f in dataclasses.fields(LossInputs)}
    assert set(FLOAT_INPUTS) | set(TOKEN_INPUTS) == set(LOSS_INPUTS)
    assert batch.FLOAT_INPUTS is FLOAT_INPUTS
    for name, tinker in convert._TINKER_LOSSES.items():  # Tinker's own facts only
        fields = LOSS_SPECS[tinker.loss_type].params_cls.model_fields
        assert set(tinker.knobs) | set(tinker.fixed) <= set(fields), name
        assert not set(tinker.extra) & set(LOSS_INPUTS), name


def _input_tables(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, name) of each loss input spelled in a module-level table: an element of a tuple,
    list or set literal, or a key of a dict literal."""
    found = []
    tables = [node for node in tree.body if isinstance(node, ast.Assign | ast.AnnAssign)]
    for statement in tables:
        for node in ast.walk(statement):
            if isinstance(node, ast.Tuple | ast.List | ast.Set):
                items: list[ast.expr | None] = list(node.elts)
            elif isinstance(node, ast.Dict):
                items = list(node.keys)
            else:
                continue
            for item in items:
                if isinstance(item, ast.Constant) and item.value in LOSS_INPUTS:
                    found.append((item.lineno, str(item.value)))
    return found


def test_loss_inputs_are_spelled_only_in_the_registry() -> None:
    registry = TRAINER / "contract" / "losses.py"
    found = {
        str(path.relative_to(TRAINER)): tables
        for path in sorted(TRAINER.rglob("*.py"))
        if path != registry and (tables := _input_tables(ast.parse(path.read_text())))
    }
    assert found == {}
    assert _input_tables(ast.parse(registry.read_text()))  # the reader sees a table


def test_an_input_added_to_a_registry_entry_is_required_on_every_face(monkeypatch) -> None:
    """PPO that also needs reference logprobs: one edit of the registry, and the HTTP edge, the
    engine and the Tinker face require the input (and the Tinker face accepts it)."""
    ppo = LOSS_SPECS["LOSS_TYPE_PPO"]
    needs = (*ppo.required, "reference_logprobs")
    monkeypatch.setitem(LOSS_SPECS, "LOSS_TYPE_PPO", dataclasses.replace(ppo, required=needs))
    floats = {"logprobs": [-1.0, -1.0], "advantages": [1.0, 1.0]}
    without = sample([1, 2], [2, 3], **floats)
    with_ref = sample([1, 2], [2, 3], **floats, reference_logprobs=[-1.0, -1.0])
    field = "samples[0].loss_fn_inputs.reference_logprobs"
    loss = LossConfig(type="ppo")
    with pytest.raises(ApiError) as refused:
        check_forward_backward(ForwardBackwardBody(loss=loss, samples=[without]), ENTRY)
    assert refused.value.param == field
    check_forward_backward(ForwardBackwardBody(loss=loss, samples=[with_ref]), ENTRY)
    kw = {"vocab_size": 8, "max_seq_length": 8, "max_batch_size": 2, "required": needs}
    with pytest.raises(OperationError, match=r"reference_logprobs: is required by this loss"):
        prepare_samples([without], **kw)
    prepare_samples([with_ref], **kw)

    def datum(**inputs: list[float]) -> dict[str, object]:
        tensors = {"target_tokens": {"data": [2, 3], "dtype": "int64"}}
        tensors |= {k: {"data": v, "dtype": "float32"} for k, v in inputs.items()}
        return {"model_input": {"chunks": [{"tokens": [1, 2]}]}, "loss_fn_inputs": tensors}

    with pytest.raises(convert.TinkerInputError) as info:
        convert.forward_backward_body({"data": [datum(**floats)], "loss_fn": "ppo"}, False)
    assert info.value.field == "forward_backward_input.data[0].loss_fn_inputs.reference_logprobs"
    ref = {**floats, "reference_logprobs": [-1.0, -1.0]}
    body = convert.forward_backward_body({"data": [datum(**ref)], "loss_fn": "ppo"}, False)
    assert "reference_logprobs" in body["samples"][0]["loss_fn_inputs"]
