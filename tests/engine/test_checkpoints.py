"""Exact resume, weights-only resume, exports that plain transformers/peft load, the catalogue."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.engine.helpers import assert_same, make_resource, random_batch, weights_of
from trainer.checkpoint.store import CheckpointCorrupt, CheckpointStore
from trainer.compute import optim
from trainer.contract.errors import OperationError
from trainer.contract.specs import AdamParams, LoraConfig, LossConfig, SessionSpec

CE = LossConfig(type="cross_entropy")
ADAM = AdamParams(learning_rate=2e-2, weight_decay=0.01)


def _train(session, steps: range) -> list[float]:
    losses = []
    for step in steps:
        out = session.forward_backward(CE, random_batch(100 + step, n=3, weights="ones"))
        session.optim_step(ADAM)
        losses.append(out["loss"])
    return losses


@pytest.mark.parametrize(
    ("lora", "dtype"),
    [(True, "float32"), (False, "float32"), (False, "bfloat16")],
    ids=["lora", "full", "full-bf16"],
)
def test_resume_is_bit_exact(tiny_qwen_dir, tmp_path, lora, dtype) -> None:
    # LoRA with dropout: the continuation also needs the session's RNG state back; bf16 full
    # weights: their fp32 masters (optim.MasterAdamW) too.
    spec = (
        SessionSpec(lora_config=LoraConfig(rank=8, dropout=0.1, seed=5)) if lora else SessionSpec()
    )
    straight = make_resource(tiny_qwen_dir, tmp_path / "store", lora=lora, dtype=dtype)
    run = straight.create_session("straight", spec)
    uninterrupted = _train(run, range(5))
    final = weights_of(run)
    straight.close()

    first = make_resource(tiny_qwen_dir, tmp_path / "store", lora=lora, dtype=dtype)
    part = first.create_session("part", spec)
    before = _train(part, range(2))
    checkpoint = part.save_training_checkpoint()
    first.close()

    # a different resource (a fresh process would look the same: everything is on disk)
    second = make_resource(tiny_qwen_dir, tmp_path / "store", lora=lora, dtype=dtype)
    resumed = second.create_session("resumed", SessionSpec(resume_from_checkpoint_id=checkpoint.id))
    masters = [s for s in resumed.optimizer.state.values() if optim.MASTER in s]
    assert len(masters) == (len(resumed.policy.trainable) if dtype == "bfloat16" else 0)
    assert resumed.step == 2 and resumed.policy_state()["trainer_step"] == 2
    after = _train(resumed, range(2, 5))
    assert before + after == uninterrupted
    assert_same(weights_of(resumed), final)

    fresh_optimizer = (
        second.create_session(
            "no-opt", SessionSpec(resume_from_checkpoint_id=checkpoint.id, load_optimizer=False)
        )
        if lora
        else None
    )
    if fresh_optimizer is not None:
        assert fresh_optimizer.step == 0
        assert fresh_optimizer.policy_state()["trainer_step"] == 0
        _train(fresh_optimizer, range(2, 5))
        differs = weights_of(fresh_optimizer)
        assert any(not torch.equal(differs[k], final[k]) for k in final)


def test_full_resume_without_optimizer_differs(tiny_qwen_dir, tmp_path) -> None:
    resource = make_resource(tiny_qwen_dir, tmp_path, lora=False)
    session = resource.create_session("a", SessionSpec())
    _train(session, range(2))
    checkpoint = session.save_training_checkpoint()
    _train(session, range(2, 4))
    with_optimizer = weights_of(session)
    resource.close_session("a")
    weights_only = resource.create_session(
        "b", SessionSpec(resume_from_checkpoint_id=checkpoint.id, load_optimizer=False)
    )
    assert weights_only.step == 0
    _train(weights_only, range(2, 4))
    got = weights_of(weights_only)
    assert any(not torch.equal(got[k], with_optimizer[k]) for k in got)


def test_resume_refuses_mismatches(tiny_qwen_dir, tiny_llama_dir, tmp_path) -> None:
    lora_res = make_resource(tiny_qwen_dir, tmp_path, lora=True)
    lora_ckpt = lora_res.create_session("a", SessionSpec()).save_training_checkpoint()
    other_base = make_resource(tiny_llama_dir, tmp_path, lora=True, name="other")
    cases = [
        (other_base, SessionSpec(resume_from_checkpoint_id=lora_ckpt.id), "base model"),
        (lora_res, SessionSpec(resume_from_checkpoint_id="ckpt-" + "0" * 32), "no checkpoint"),
        (lora_res, SessionSpec(resume_from_checkpoint_id="../../etc"), "no checkpoint"),
    ]
    full_res = make_resource(tiny_qwen_dir, tmp_path, lora=False)
    cases.append((full_res, SessionSpec(resume_from_checkpoint_id=lora_ckpt.id), "lora_enabled"))
    for resource, spec, words in cases:
        with pytest.raises(OperationError) as info:
            resource.create_session("x", spec)
        assert info.value.code == "INVALID_INPUT"
        assert info.value.message.startswith("resume_from_checkpoint_id")
        assert words in info.value.message


def test_a_lora_sampler_checkpoint_resumes_into_full_weights_merged(
    tiny_model_dir, tmp_path
) -> None:
    """A LoRA inference checkpoint resumes into a full-weight resource (how a `merged_base`
    model deploys): weights only, the adapter merged in, head included, as plain transformers
    loads the checkpoint's merged model. A LoRA training checkpoint still needs a LoRA
    resource (the test above)."""
    from transformers import AutoModelForCausalLM

    lora_res = make_resource(tiny_model_dir, tmp_path, lora=True)
    session = lora_res.create_session("a", SessionSpec(lora_config=LoraConfig(rank=4, seed=1)))
    _train(session, range(2))
    checkpoint = session.save_inference_checkpoint()
    full_res = make_resource(tiny_model_dir, tmp_path, lora=False)
    spec = SessionSpec(resume_from_checkpoint_id=checkpoint.id)
    full = full_res.create_session("b", spec)
    assert full.step == 0
    tokens = [3, 17, 29, 4, 88, 61, 12]
    with full.operation_scope(), full.policy.training(train=False):
        got = _logprobs(full.policy.model, tokens)
    merged = AutoModelForCausalLM.from_pretrained(checkpoint.path / "merged", dtype=torch.float32)
    torch.testing.assert_close(got, _logprobs(merged.eval(), tokens), atol=1e-5, rtol=1e-5)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    assert not torch.allclose(got, _logprobs(base, tokens), atol=1e-3)  # it was trained
    full_res.close_session("b")
    with pytest.raises(OperationError, match=r"^load_optimizer"):
        full_res.create_session("c", spec.model_copy(update={"load_optimizer": True}))


def test_corrupted_checkpoint_is_refused(tiny_qwen_dir, tmp_path) -> None:
    resource = make_resource(tiny_qwen_dir, tmp_path)
    checkpoint = resource.create_session("a", SessionSpec()).save_training_checkpoint()
    weights = checkpoint.path / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(OperationError, match="sha256"):
        resource.create_session("b", SessionSpec(resume_from_checkpoint_id=checkpoint.id))


# -- exports ------------------------------------------------------------------------------------


def _logprobs(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0].float(), -1)


def test_lora_exports_reload_in_peft_and_transformers(tiny_model_dir, tmp_path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    resource = make_resource(tiny_model_dir, tmp_path)
    session = resource.create_session("a", SessionSpec(lora_config=LoraConfig(rank=8, seed=1)))
    for step in range(3):
        session.forward_backward(CE, random_batch(step, weights="ones"))
        session.optim_step(AdamParams(learning_rate=5e-2))
    tokens = [3, 17, 29, 4, 88, 61, 12]
    with session.operation_scope(), session.policy.training(train=False):
        expected = _logprobs(session.policy.model, tokens)
    checkpoint = session.save_inference_checkpoint()

    adapter_dir = checkpoint.path / "adapter"
    assert sorted(p.name for p in adapter_dir.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    from safetensors.torch import load_file

    adapter = load_file(str(adapter_dir / "adapter_model.safetensors"))
    assert all("lora_" in key for key in adapter), "no base weights inside the adapter"
    assert any("lm_head" in key for key in adapter)
    rank8_size = sum(t.numel() * t.element_size() for t in adapter.values())
    assert (adapter_dir / "adapter_model.safetensors").stat().st_size < rank8_size + 64 * 1024

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, adapter_dir).eval()
    torch.testing.assert_close(_logprobs(peft_model, tokens), expected, atol=1e-5, rtol=0)

    merged = AutoModelForCausalLM.from_pretrained(
        checkpoint.path / "merged", dtype=torch.float32
    ).eval()
    torch.testing.assert_close(_logprobs(merged, tokens), expected, atol=1e-5, rtol=1e-5)
    config = json.loads((checkpoint.path / "merged" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False  # the trained head is its own weight now
    # the base model in memory was never merged into
    fresh = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    for name, param in fresh.named_parameters():
        key = name.replace(".weight", ".base_layer.weight")
        live = dict(resource.model.named_parameters())
        assert torch.equal(live.get(name, live.get(key)), param), name


def test_full_export_reloads_and_resumes_from_hf_dir(tiny_model_dir, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    resource = make_resource(tiny_model_dir, tmp_path, lora=False)
    session = resource.create_session("a", SessionSpec())
    _train(session, range(2))
    tokens = [5, 9, 33, 2, 71]
    with session.operation_scope(), session.policy.training(train=False):
        expected = _logprobs(session.policy.model, tokens)
    trained = weights_of(session)
    checkpoint = session.save_inference_checkpoint()
    assert not (checkpoint.path / "adapter").exists()
    merged = AutoModelForCausalLM.from_pretrained(checkpoint.path / "merged", dtype=torch.float32)
    torch.testing.assert_close(_logprobs(merged.eval(), tokens), expected, atol=1e-5, rtol=0)

    resource.close_session("a")
    hf = resource.create_session(
        "b", SessionSpec(resume_from_hf_checkpoint=str(checkpoint.path / "merged"))
    )
    assert hf.step == 0
    assert_same(weights_of(hf), trained)


@pytest.mark.parametrize("family", ["qwen3", "gemma3_composite"])
def test_a_full_model_with_its_own_head_resumes_into_a_tied_resource(
    tiny_qwen_dir, tmp_path, family: str
) -> None:
    """A full model directory whose output head is its own (untied, unlike the embedding)
    keeps it when a tied base model's full-weight session starts from it: a causal LM, and a
    composite whose embedding sits inside its language model."""
    import transformers

    from trainer.compute.model import save_merged
    from trainer.tiny_families import _COMPOSITE_CLASSES, save_family

    base = tiny_qwen_dir if family == "qwen3" else save_family(family, tmp_path / family)
    cls = getattr(transformers, _COMPOSITE_CLASSES.get(family, "AutoModelForCausalLM"))
    model = cls.from_pretrained(base, dtype=torch.float32)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied
    model.config.tie_word_embeddings = False
    if hasattr(model.config, "text_config"):
        model.config.text_config.tie_word_embeddings = False
    head = model.get_output_embeddings()
    head.weight = torch.nn.Parameter(torch.randn_like(head.weight))
    own_head = tmp_path / "own-head"
    save_merged(model, own_head, {})  # as the worker exports a merged model
    full = make_resource(base, tmp_path / "storage", lora=False)
    session = full.create_session("b", SessionSpec(resume_from_hf_checkpoint=str(own_head)))
    with session.operation_scope(), session.policy.training(train=False):
        got = _logprobs(session.policy.model, [3, 17, 29, 4, 88, 61, 12])
    want = cls.from_pretrained(own_head, dtype=torch.float32).eval()
    assert torch.equal(got, _logprobs(want, [3, 17, 29, 4, 88, 61, 12]))
    tied = cls.from_pretrained(base, dtype=torch.float32).eval()
    assert not torch.allclose(got, _logprobs(tied, [3, 17, 29, 4, 88, 61, 12]), atol=1e-3)


def test_lora_resume_from_hf_adapter_dir(tiny_qwen_dir, tmp_path) -> None:
    resource = make_resource(tiny_qwen_dir, tmp_path)
    session = resource.create_session("a", SessionSpec(lora_config=LoraConfig(rank=4, seed=3)))
    _train(session, range(2))
    checkpoint = session.save_inference_checkpoint()
    copy = tmp_path / "exported-adapter"
    shutil.copytree(checkpoint.path / "adapter", copy)
    again = resource.create_session("b", SessionSpec(resume_from_hf_checkpoint=str(copy)))
    assert_same(weights_of(again), weights_of(session))
    with pytest.raises(OperationError, match="PEFT adapter"):
        resource.create_session(
            "c", SessionSpec(resume_from_hf_checkpoint=str(checkpoint.path / "merged"))
        )
    # a full-weight resource takes the adapter merged into its weights
    full = make_resource(tiny_qwen_dir, tmp_path / "full", lora=False)
    merged_session = full.create_session("d", SessionSpec(resume_from_hf_checkpoint=str(copy)))
    tokens = [4, 8, 15, 16, 23, 42]
    with merged_session.operation_scope():
        got = _logprobs(merged_session.policy.model, tokens)
    with session.operation_scope(), session.policy.training(train=False):
        want = _logprobs(session.policy.model, tokens)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


# -- the catalogue ------------------------------------------------------------------------------


def test_catalogue_survives_restart_and_sweeps_partials(tiny_qwen_dir, tmp_path) -> None:
    resource = make_resource(tiny_qwen_dir, tmp_path)
    session = resource.create_session("a", SessionSpec(lora_config=LoraConfig(rank=4)))
    training = session.save_training_checkpoint()
    inference = session.save_inference_checkpoint()
    resource.store.close()
    (tmp_path / "tmp" / "ckpt-dead.partial").mkdir()
    (tmp_path / "tmp" / "ckpt-dead.partial" / "weights.safetensors").write_bytes(b"half")

    store = CheckpointStore(tmp_path)
    assert not list((tmp_path / "tmp").iterdir())
    listed = store.list()  # newest first
    assert [r.id for r in listed] == [inference.id, training.id]
    assert listed[1].type == "CHECKPOINT_TYPE_TRAINING" and listed[1].lora_rank == 4
    assert listed[1].session_id == "a" and listed[1].base_model == "tiny"
    assert store.list(type="CHECKPOINT_TYPE_INFERENCE")[0].id == inference.id
    assert store.list(after=inference.id) == [listed[1]]
    assert store.list(session_id="nobody") == []
    assert store.list(base_model="tiny", limit=1) == [listed[0]]
    names = [name for name, _ in store.files(inference.id, "ADAPTER")]
    assert names == ["adapter_config.json", "adapter_model.safetensors"]
    assert "model.safetensors" in [name for name, _ in store.files(inference.id, "MERGED")]
    with pytest.raises(KeyError):
        store.files(training.id, "MERGED")
    _record, manifest = store.open(training.id)
    assert set(manifest["files"]) == {
        "optimizer.safetensors",
        "rng.safetensors",
        "state.json",
        "weights.safetensors",
    }


def test_failed_write_leaves_nothing(tmp_path) -> None:
    store = CheckpointStore(tmp_path)

    def broken(out):
        (out / "weights.safetensors").write_bytes(b"x" * 10)
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        store.write(
            type="CHECKPOINT_TYPE_TRAINING",
            session_id="s",
            step=0,
            base_model="m",
            lora_rank=None,
            writer=broken,
        )
    assert store.list() == []
    assert not list((tmp_path / "tmp").iterdir())
    assert not list((tmp_path / "checkpoints").iterdir())


def test_adopts_renamed_but_unlisted_checkpoint(tmp_path) -> None:
    store = CheckpointStore(tmp_path)
    record = store.write(
        type="CHECKPOINT_TYPE_TRAINING",
        session_id="s",
        step=3,
        base_model="m",
        lora_rank=None,
        writer=lambda out: (out / "state.json").write_text("{}"),
    )
    store._db.execute("DELETE FROM checkpoints")  # a crash between rename and insert
    store._db.commit()
    store.close()
    again = CheckpointStore(tmp_path)
    assert [r.id for r in again.list()] == [record.id]
    assert again.get(record.id).step == 3  # type: ignore[union-attr]
    with pytest.raises(CheckpointCorrupt):
        (record.path / "state.json").write_text("{tampered}")
        again.open(record.id)


OLD_CHECKPOINTS = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoints_v1"


def test_checkpoint_written_before_the_unified_engine_resumes(tiny_qwen_dir, tmp_path) -> None:
    """A LoRA training checkpoint (format 1) written by the engine as it was before
    `checkpoint/layout.py` (commit 2a2a826: rank 2, dropout 0.1, two PPO steps) resumes with its
    step, weights, both AdamW moments and RNG state exactly as stored, then trains on."""
    (fixture,) = OLD_CHECKPOINTS.iterdir()
    storage = tmp_path / "store"
    (storage / "checkpoints").mkdir(parents=True)
    shutil.copytree(fixture, storage / "checkpoints" / fixture.name)  # adopted at start-up
    resource = make_resource(tiny_qwen_dir, storage)
    session = resource.create_session(
        "resumed", SessionSpec(resume_from_checkpoint_id=fixture.name)
    )
    assert json.loads((fixture / "state.json").read_text())["format"] == 1
    assert session.step == 2 and session.policy_state()["trainer_step"] == 2
    assert session.policy.config == LoraConfig(rank=2, alpha=4, dropout=0.1, seed=5)
    assert_same(weights_of(session), load_file(str(fixture / "weights.safetensors")))
    optimizer = optim.state_tensors(session.optimizer, session.policy.trainable)
    assert_same(optimizer, load_file(str(fixture / "optimizer.safetensors")))
    assert_same(session.rng_tensors(), load_file(str(fixture / "rng.safetensors")))
    _train(session, range(1))
    assert session.step == 3
    resource.close()


def test_an_adapter_export_resumes_into_full_weights_merged(tiny_llama_dir, tmp_path) -> None:
    """An unencrypted adapter export holds no merged model: a full-weight session starts from
    its adapter, merged into the base weights as from a PEFT directory (Llama: its untied head
    lets peft's own merge be the reference)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trainer.checkpoint.export import AdapterExport

    lora_res = make_resource(tiny_llama_dir, tmp_path, lora=True)
    session = lora_res.create_session("a", SessionSpec(lora_config=LoraConfig(rank=4, seed=1)))
    _train(session, range(2))
    export = session.save_inference_checkpoint(export=AdapterExport(naming="peft"))
    assert not (export.path / "merged").exists()
    full = make_resource(tiny_llama_dir, tmp_path, lora=False)
    served = full.create_session("b", SessionSpec(resume_from_checkpoint_id=export.id))
    tokens = [3, 17, 29, 4, 88, 61, 12]
    with served.operation_scope(), served.policy.training(train=False):
        got = _logprobs(served.policy.model, tokens)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, export.path / "adapter").merge_and_unload().eval()
    torch.testing.assert_close(got, _logprobs(merged, tokens), atol=1e-5, rtol=1e-5)
