"""Specs refuse bad values with a message that names the field, and apply the defaults of
docs/semantics.md §14."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from trainer.contract.specs import (
    AdamParams,
    GrpoParams,
    LoraConfig,
    LossConfig,
    ModelEntry,
    ResourceSpec,
    SessionSpec,
    TensorData,
)


def test_defaults_follow_part_b() -> None:
    assert AdamParams().model_dump() == {
        "learning_rate": 1e-4,
        "beta1": 0.9,
        "beta2": 0.95,
        "eps": 1e-8,
        "weight_decay": 0.0,
        "grad_clip_norm": 1.0,
    }
    lora = LoraConfig()
    assert (lora.rank, lora.alpha, lora.dropout, lora.seed, lora.train_unembed) == (
        32,
        64,
        0.0,
        None,
        True,
    )
    grpo = LossConfig(type="LOSS_TYPE_GRPO").params()
    assert isinstance(grpo, GrpoParams)
    assert (grpo.clip_low_threshold, grpo.clip_high_threshold, grpo.beta) == (0.8, 1.28, 0.0)
    ppo = LossConfig(type="ppo").params()
    assert (ppo.clip_low_threshold, ppo.clip_high_threshold) == (0.8, 1.2)  # type: ignore[attr-defined]
    cispo = LossConfig(type="cispo").params()
    assert (cispo.clip_low_threshold, cispo.clip_high_threshold) == (0.0, 5.0)  # type: ignore[attr-defined]
    dppo = LossConfig(type="dppo").params()
    assert (dppo.delta_low, dppo.delta_high) == (0.15, 0.15)  # type: ignore[attr-defined]
    assert ResourceSpec(base_model="m").inactive_timeout == 3600


def test_protobuf_strings_are_accepted() -> None:
    assert TensorData(data=["5", 7], dtype="int64").data == [5, 7]
    assert LoraConfig(seed="12").seed == 12


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: LossConfig(type="dro"), "dro_params.beta"),
        (lambda: LossConfig(type="LOSS_TYPE_UNSPECIFIED"), "LOSS_TYPE_UNSPECIFIED"),
        (lambda: LossConfig(type="nope"), "type"),
        (lambda: LossConfig(type="ppo", ppo_params={"clip_low_threshold": 1.5}), "clip_low"),
        (lambda: LossConfig(type="dppo", dppo_params={"delta_low": 2}), "delta_low"),
        (lambda: TensorData(data=[1.5], dtype="int64"), "data[0]"),
        (lambda: TensorData(data=[1, 2], dtype="float32", shape=[3]), "shape"),
        (lambda: TensorData(data=[1], dtype="float16"), "dtype"),
        (lambda: TensorData(data=["x"], dtype="int64"), "data"),
        (lambda: LoraConfig(rank=0), "rank"),
        (lambda: LoraConfig(dropout=1.0), "dropout"),
        (lambda: AdamParams(learning_rate=-1), "learning_rate"),
        (lambda: AdamParams(beta2=1.0), "beta2"),
        (lambda: SessionSpec(display_name="x" * 129), "display_name"),
        (
            lambda: SessionSpec(resume_from_checkpoint_id="a", resume_from_hf_checkpoint="b"),
            "mutually exclusive",
        ),
        (
            lambda: SessionSpec(resume_from_hf_checkpoint="b", load_optimizer=True),
            "load_optimizer",
        ),
        (lambda: ResourceSpec(base_model="m", inactive_timeout=10), "inactive_timeout"),
        (
            lambda: ResourceSpec(base_model="m", optimizer_config={"muon": {"scaling": 1}}),
            "optimizer_config.muon.scaling",
        ),
        (
            lambda: ResourceSpec(base_model="m", optimizer_config={"muon": {}, "adam": {}}),
            "not both",
        ),
        (lambda: ModelEntry(name="m", location="x", typo=1), "typo"),
    ],
)
def test_bad_values_name_the_field(build, field) -> None:
    with pytest.raises(ValidationError) as info:
        build()
    assert field in str(info.value)
