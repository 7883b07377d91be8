"""`lora_config.init_method` (docs/semantics.md §23): PEFT's Kaiming-uniform A, or NoRA, that A
with each input column scaled to unit L2 norm over the rank; B zero either way."""

from __future__ import annotations

import pytest
import torch

from tests.engine.helpers import make_resource, random_batch
from trainer.contract.errors import OperationError
from trainer.contract.specs import LoraConfig, LossConfig, SessionSpec

CE = LossConfig(type="cross_entropy")


def _lora(method: str, seed: int = 3) -> SessionSpec:
    return SessionSpec(lora_config=LoraConfig(rank=4, seed=seed, init_method=method))  # type: ignore[arg-type]


def test_nora_is_the_kaiming_init_with_unit_columns(tiny_model_dir, tmp_path) -> None:
    resource = make_resource(tiny_model_dir, tmp_path)
    kaiming = resource.create_session("k", _lora("kaiming")).policy.trainable
    nora = resource.create_session("n", _lora("nora")).policy.trainable
    assert kaiming.keys() == nora.keys()
    a_names = [n for n in nora if ".lora_A." in n]
    assert a_names and any("lm_head" in n for n in a_names)  # the head's adapter too
    for name in nora:
        k, n = kaiming[name].detach(), nora[name].detach()
        if ".lora_B." in name:
            assert not n.any()
            continue
        want = k / torch.linalg.vector_norm(k, dim=0, keepdim=True)  # [rank, in]: per column
        torch.testing.assert_close(n, want, atol=0, rtol=1e-6)
        torch.testing.assert_close(
            torch.linalg.vector_norm(n, dim=0), torch.ones(n.shape[1]), atol=1e-6, rtol=0
        )
    # B = 0: its logprobs are the base model's, and it trains
    batch = random_batch(4, n=2, weights="ones")
    out = resource.sessions["n"].forward_backward(CE, batch, forward_only=True)
    base = resource.sessions["k"].forward_backward(CE, batch, forward_only=True)
    assert out["loss"] == base["loss"]
    resource.close()


def test_the_default_stays_out_of_the_wire_and_nora_travels() -> None:
    assert "init_method" not in LoraConfig(rank=2).model_dump(mode="json")
    dumped = LoraConfig(rank=2, init_method="nora").model_dump(mode="json")
    assert LoraConfig.model_validate(dumped).init_method == "nora"


def test_nora_on_fused_experts_is_refused_naming_the_field(tiny_moe_dir, tmp_path) -> None:
    resource = make_resource(tiny_moe_dir, tmp_path)
    with pytest.raises(OperationError, match=r"^lora_config.init_method: nora is not served"):
        resource.create_session("n", _lora("nora"))
    assert resource.create_session("k", _lora("kaiming")).policy.trainable
    resource.close()
