"""The precision of a merged model's files (docs/semantics.md §23, `compute/precision.py`): a
`merged_base` save at `bf16`, or at `source` (the base model's stored dtype), is the merge at
the trainer's precision rounded once, the tensors its class keeps in float32 kept; and a
full-weight session resuming from a LoRA sampler checkpoint serves those files (what a promoted
`merged_base` model deploys)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, DeepseekV3ForCausalLM

from tests.engine.helpers import make_resource, random_batch
from trainer.contract.specs import AdamParams, LoraConfig, LossConfig, SessionSpec
from trainer.tiny_families import save_family

CE = LossConfig(type="cross_entropy")
ADAM = AdamParams(learning_rate=2e-2)
TOKENS = [3, 17, 29, 4, 88, 61, 12]


def _trained(resource, name: str = "a"):
    session = resource.create_session(name, SessionSpec(lora_config=LoraConfig(rank=4, seed=1)))
    for step in range(2):
        session.forward_backward(CE, random_batch(200 + step, n=3, weights="ones"))
        session.optim_step(ADAM)
    return session


def _merged(checkpoint) -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint.path / "merged" / "model.safetensors"))


def _config(checkpoint) -> dict:
    return json.loads((checkpoint.path / "merged" / "config.json").read_text())


def _logprobs(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0].float(), -1)


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """MLA + MoE; its class keeps the router's weight and bias in float32 at any dtype."""
    return save_family("deepseek_v3", tmp_path_factory.mktemp("deepseek-v3"))


@pytest.mark.parametrize("family", ["qwen3", "llama", "deepseek_v3"])
def test_a_bf16_export_is_the_merge_rounded_once(
    family: str, tiny_qwen_dir: Path, tiny_llama_dir: Path, deepseek_dir: Path, tmp_path: Path
) -> None:
    model_dir = {"qwen3": tiny_qwen_dir, "llama": tiny_llama_dir, "deepseek_v3": deepseek_dir}
    session = _trained(make_resource(model_dir[family], tmp_path))
    exact = session.save_inference_checkpoint()  # the trainer's precision: float32
    rounded = session.save_inference_checkpoint(merged=True, precision="bf16")
    want, got = _merged(exact), _merged(rounded)
    assert want.keys() == got.keys()
    # what the class keeps in float32 at 16 bits (transformers 5.17 keeps the bias alone)
    strict = {"deepseek_v3": DeepseekV3ForCausalLM._keep_in_fp32_modules_strict}
    kept = [name for name in got if any(k in name for k in strict.get(family, ()))]
    assert bool(kept) == (family == "deepseek_v3")
    for name, tensor in want.items():
        assert tensor.dtype == torch.float32, name
        expected = tensor if name in kept else tensor.to(torch.bfloat16)
        assert got[name].dtype == expected.dtype and torch.equal(got[name], expected), name
    assert _config(rounded)["dtype"] == "bfloat16"
    assert _config(exact)["dtype"] == "float32"
    # the adapter beside it is the trainer's, untouched by the export's precision
    assert load_file(str(exact.path / "adapter" / "adapter_model.safetensors")).keys() == (
        load_file(str(rounded.path / "adapter" / "adapter_model.safetensors")).keys()
    )
    loaded = AutoModelForCausalLM.from_pretrained(rounded.path / "merged", dtype="auto")
    assert loaded.dtype == torch.bfloat16


def test_source_is_the_base_models_stored_dtype(tiny_qwen_dir: Path, tmp_path: Path) -> None:
    """A base stored in bf16, trained in float32: `source` writes the merge back in bf16. A
    base stored in float32 writes float32, as a save without an export precision does."""
    stored_bf16 = tmp_path / "qwen3-bf16"
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen_dir, dtype=torch.float32)
    base.to(torch.bfloat16).save_pretrained(stored_bf16)
    for model_dir, dtype in ((stored_bf16, torch.bfloat16), (tiny_qwen_dir, torch.float32)):
        resource = make_resource(model_dir, tmp_path / dtype.__repr__())
        session = _trained(resource)
        assert session.policy.model.dtype == torch.float32  # the trainer's precision
        exact = _merged(session.save_inference_checkpoint())
        source = session.save_inference_checkpoint(merged=True, precision="source")
        got = _merged(source)
        assert got.keys() == exact.keys()
        for name, tensor in exact.items():
            assert torch.equal(got[name], tensor.to(dtype)), name
        assert _config(source)["dtype"] == str(dtype).removeprefix("torch.")


def test_a_full_weight_resume_serves_the_merged_files(tiny_qwen_dir: Path, tmp_path: Path) -> None:
    """Full weights from a LoRA sampler checkpoint are its merged model's files: the bf16
    export's numbers, not the float32 merge's."""
    lora = make_resource(tiny_qwen_dir, tmp_path)
    session = _trained(lora)
    exact = session.save_inference_checkpoint(merged=True, precision="source")
    rounded = session.save_inference_checkpoint(merged=True, precision="bf16")
    full = make_resource(tiny_qwen_dir, tmp_path, lora=False)
    seen = {}
    for checkpoint in (exact, rounded):
        served = full.create_session(
            checkpoint.id, SessionSpec(resume_from_checkpoint_id=checkpoint.id)
        )
        with served.operation_scope(), served.policy.training(train=False):
            seen[checkpoint.id] = _logprobs(served.policy.model, TOKENS)
        full.close_session(checkpoint.id)
        files = AutoModelForCausalLM.from_pretrained(
            checkpoint.path / "merged", dtype=torch.float32
        )
        assert torch.equal(seen[checkpoint.id], _logprobs(files.eval(), TOKENS))
    assert not torch.equal(seen[exact.id], seen[rounded.id])


def test_a_decision_calibration_is_the_checkpoints_decision_json(
    tiny_qwen_dir: Path, tmp_path: Path
) -> None:
    session = _trained(make_resource(tiny_qwen_dir, tmp_path))
    decision = {"contract": "systemone-letter-v1", "temperature": {"choice": 1.5}}
    checkpoint = session.save_inference_checkpoint(decision=decision)
    assert json.loads((checkpoint.path / "decision.json").read_text()) == decision
    assert not (session.save_inference_checkpoint().path / "decision.json").exists()


def test_a_composites_export_names_its_dtype_in_every_sub_config(tmp_path: Path) -> None:
    """Gemma 3 with its vision tower: every floating tensor is bf16, and each sub-model's
    config names the dtype too, so `dtype="auto"` loads the whole composite in bf16."""
    import transformers

    model_dir = save_family("gemma3_composite", tmp_path / "gemma3")
    session = _trained(make_resource(model_dir, tmp_path / "storage"))
    rounded = session.save_inference_checkpoint(merged=True, precision="bf16")
    assert {t.dtype for t in _merged(rounded).values()} == {torch.bfloat16}
    config = _config(rounded)
    assert config["dtype"] == config["text_config"]["dtype"] == "bfloat16"
    assert config["vision_config"]["dtype"] == "bfloat16"
    cls = transformers.Gemma3ForConditionalGeneration
    loaded = cls.from_pretrained(rounded.path / "merged", dtype="auto")
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}


def test_a_float16_export_keeps_what_transformers_keeps_in_float32(tmp_path: Path) -> None:
    """GPT-OSS keeps its norms in float32 when it loads in float16 (`_keep_in_fp32_modules`),
    and nothing more in bfloat16: an export at either dtype keeps what a load would."""
    from trainer.compute.precision import kept_in_fp32
    from trainer.tiny_families import build_family

    model = build_family("gpt_oss")
    assert kept_in_fp32(model, torch.bfloat16) == []
    kept = kept_in_fp32(model, torch.float16)
    assert {"input_layernorm", "post_attention_layernorm", "norm"} <= set(kept), kept
