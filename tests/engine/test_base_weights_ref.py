"""`base_weights_ref`: a full-weight resource trains from an inference checkpoint's merged model.

The reference is a plain transformers load of the checkpoint's `merged/` export; the worker's
logprobs on the ref resource must equal it (and differ from the catalogue base's), in a first
session and in a fresh one after another session has trained (`_reload_base`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.api.api_helpers import load_causal_lm, reference_logprobs
from tests.engine.helpers import make_resource, random_batch, sample
from trainer.checkpoint.base_weights import FIELD, RefError, check_ref
from trainer.checkpoint.store import CheckpointStore
from trainer.compute.model import is_tied, read_model_config
from trainer.contract.specs import (
    AdamParams,
    LoraConfig,
    LossConfig,
    ModelEntry,
    ResourceSpec,
    SessionSpec,
)
from trainer.engine.resource import ModelResource

CE = LossConfig(type="cross_entropy")
PROBES = [[3, 17, 42, 9, 88, 5, 61, 20], [7, 7, 100, 2, 45, 12]]


def _trained_checkpoint(model_dir: Path, storage: Path, lora: bool) -> Path:
    """An inference checkpoint of a trained session (LoRA with a head adapter: an untied
    export of a tied model; full weights: a tied one). Returns its directory."""
    resource = make_resource(model_dir, storage, lora=lora)
    spec = SessionSpec(lora_config=LoraConfig(rank=4, seed=2)) if lora else SessionSpec()
    session = resource.create_session("src", spec)
    for step in range(3):
        session.forward_backward(CE, random_batch(step, weights="ones"))
        session.optim_step(AdamParams(learning_rate=5e-2))
    record = session.save_inference_checkpoint()
    resource.close()
    return record.path


def _ref_resource(model_dir: Path, storage: Path, ref: str, lora: bool = False) -> ModelResource:
    entry = ModelEntry(name="tiny", location=str(model_dir), max_seq_length=256)
    spec = ResourceSpec(
        base_model="tiny",
        base_weights_ref=ref,
        lora_enabled=lora,
        compute_config={"num_generator_replicas": 1},
    )
    return ModelResource(entry, spec, CheckpointStore(storage), device="cpu")


def _worker_logprobs(session) -> list[torch.Tensor]:
    probes = [sample(seq[:-1], seq[1:], weights=[1.0] * (len(seq) - 1)) for seq in PROBES]
    out = session.forward_backward(CE, probes, forward_only=True, return_loss_fn_outputs=True)
    return [torch.tensor(o["tensors"]["logprobs"]["data"]) for o in out["loss_fn_outputs"]]


def _expected(model_dir: Path) -> list[torch.Tensor]:
    model = load_causal_lm(model_dir)
    return [torch.tensor(reference_logprobs(model, seq)) for seq in PROBES]


def _assert_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)


@pytest.mark.parametrize("source", ["lora", "full", "moe-lora"])
def test_sessions_start_from_the_checkpoint_merged_model(
    request: pytest.FixtureRequest, tmp_path: Path, source: str
) -> None:
    """`lora`: a tied Qwen3's LoRA export with a head adapter (untied); `full`: its full-weight
    export (tied); `moe-lora`: a tiny Qwen3-MoE's LoRA export (experts adapted too)."""
    model_dir = request.getfixturevalue("tiny_moe_dir" if "moe" in source else "tiny_qwen_dir")
    checkpoint = _trained_checkpoint(model_dir, tmp_path, lora="lora" in source)
    merged = checkpoint / "merged"
    expected, base = _expected(merged), _expected(model_dir)
    assert max((e - b).abs().max().item() for e, b in zip(expected, base)) > 1e-2

    resource = _ref_resource(model_dir, tmp_path, checkpoint.name)
    # a LoRA head adapter untied the export: the resource's head is its own weight too
    assert is_tied(resource.model) == (source == "full")  # tiny_moe_dir is tied too
    first = resource.create_session("a", SessionSpec())
    assert first.step == 0
    _assert_close(_worker_logprobs(first), expected)
    for step in range(2):  # train away from the checkpoint's weights
        first.forward_backward(CE, random_batch(10 + step, weights="ones"))
        first.optim_step(AdamParams(learning_rate=5e-2))
    moved = _worker_logprobs(first)
    assert max((m - e).abs().max().item() for m, e in zip(moved, expected)) > 1e-3
    resource.close_session("a")

    second = resource.create_session("b", SessionSpec())  # restarts from the ref, not the base
    _assert_close(_worker_logprobs(second), expected)
    assert is_tied(resource.model) == (source == "full")
    # the generator starts from the same weights: a sampled sequence's logprobs are the ref's
    with second.operation_scope(), second.policy.published() as generator:
        probs = reference_logprobs(generator, PROBES[0])
    torch.testing.assert_close(torch.tensor(probs), expected[0], atol=1e-5, rtol=0)


def test_bad_refs_are_refused(tiny_qwen_dir: Path, tiny_llama_dir: Path, tmp_path: Path) -> None:
    qwen_storage, llama_storage = tmp_path / "qwen", tmp_path / "llama"
    inference = _trained_checkpoint(tiny_qwen_dir, qwen_storage, lora=False).name
    resource = make_resource(tiny_qwen_dir, qwen_storage, lora=False)
    training = resource.create_session("t", SessionSpec()).save_training_checkpoint().id
    resource.close()
    other = _trained_checkpoint(tiny_llama_dir, llama_storage, lora=False).name
    # the llama checkpoint, catalogued in the same store as the qwen ones
    store = CheckpointStore(llama_storage)
    config = read_model_config(str(tiny_qwen_dir))

    def refused(store: CheckpointStore, ref: str, lora: bool, words: str) -> None:
        with pytest.raises(RefError, match=words) as info:
            check_ref(store, ref, lora, "tiny", config)
        assert str(info.value).startswith(f"{FIELD}: ")

    qwen = CheckpointStore(qwen_storage)
    assert check_ref(qwen, inference, False, "tiny", config) == qwen_storage.joinpath(
        "checkpoints", inference, "merged"
    )
    refused(qwen, "ckpt-" + "0" * 32, False, "no checkpoint")
    refused(qwen, "not-an-id", False, "no checkpoint")
    refused(qwen, training, False, "training checkpoint")
    refused(qwen, inference, True, "lora_enabled false")
    refused(store, other, False, "does not match base_model 'tiny': model_type is 'llama'")

    # the loader checks again (the architecture against the loaded model): nothing half-built
    with pytest.raises(RefError, match="model_type"):
        _ref_resource(tiny_qwen_dir, llama_storage, other)
    with pytest.raises(RefError, match="training checkpoint"):
        _ref_resource(tiny_qwen_dir, qwen_storage, training)
    with pytest.raises(RefError, match="LoRA resource"):
        _ref_resource(tiny_qwen_dir, qwen_storage, inference, lora=True)


def test_architecture_check_reads_expert_shapes() -> None:
    """Same model_type, another expert count or expert width: refused, naming the config
    field; a raw config.json (defaults left out) still matches its full dict."""
    from trainer.checkpoint.base_weights import check_architecture
    from trainer.tiny import TinySpec, hf_config

    config = hf_config(TinySpec(arch="qwen3_moe"))
    moe = config.to_dict()
    for change, key in (({"experts": 8}, "experts"), ({"moe_intermediate": 32}, "moe_inter")):
        other = hf_config(TinySpec(arch="qwen3_moe", **change)).to_dict()
        with pytest.raises(RefError, match=f"{key}.* is 8|{key}.* is 32"):
            check_architecture("ckpt-x", other, "tiny", moe)
    # as a hub config.json: defaults left out, `num_experts` (the alias of num_local_experts)
    raw = {k: v for k, v in moe.items() if k not in ("attention_bias", "mlp_only_layers")}
    raw["num_experts"] = raw.pop("num_local_experts")
    check_architecture("ckpt-x", moe, "tiny", raw)
    with pytest.raises(RefError, match="attention_bias"):
        check_architecture("ckpt-x", moe, "tiny", {**raw, "attention_bias": True})
