"""Muon (docs/semantics.md §10) in one process: the tensor split, the update against a float64
reference written here from the rule's formulas, the Adam side bit-exact against
`torch.optim.AdamW`, one global clip, and bit-exact resume from a training checkpoint."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.engine.helpers import assert_same, grads_of, random_batch, weights_of
from trainer.checkpoint.store import CheckpointStore
from trainer.compute.muon import MuonWithAdamW, muon_split
from trainer.compute.optim import MASTER
from trainer.contract.errors import OperationError
from trainer.contract.muon_params import MuonParams
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
MATCH = "MUON_SCALING_STRATEGY_MATCH_ADAM"
ORIGINAL = "MUON_SCALING_STRATEGY_ORIGINAL"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def muon_resource(
    model_dir: Path, storage: Path, *, lora: bool = True, strategy: str | None = MATCH
) -> ModelResource:
    entry = ModelEntry(name="tiny", location=str(model_dir), max_seq_length=256, max_lora_rank=64)
    config = {"muon": {"scaling_strategy": strategy}} if strategy else {"adam": {}}
    spec = ResourceSpec(
        base_model="tiny",
        lora_enabled=lora,
        optimizer_config=config,
        compute_config={"num_generator_replicas": 0},
    )
    return ModelResource(entry, spec, CheckpointStore(storage), device="cpu")


# -- the split --------------------------------------------------------------------------------


def _expected_muon(names: list[str], lora: bool) -> set[str]:
    """Rule 10 restated: the projections' matrices inside decoder layers (LoRA: A and B)."""
    suffixes = ("lora_A.weight", "lora_B.weight") if lora else ("weight",)
    return {
        n
        for n in names
        if re.search(r"\.layers\.\d+\.", n)
        and any(f".{proj}.{s}" in n for proj in PROJECTIONS for s in suffixes)
    }


@pytest.mark.parametrize(
    ("kind", "lora", "train_unembed"),
    [
        ("qwen3", True, True),
        ("qwen3", True, False),
        ("llama", True, True),
        ("llama", True, False),
        ("qwen3", False, None),
        ("llama", False, None),
    ],
)
def test_split_by_tensor(kind, lora, train_unembed, tiny_qwen_dir, tiny_llama_dir, tmp_path):
    model_dir = tiny_qwen_dir if kind == "qwen3" else tiny_llama_dir
    resource = muon_resource(model_dir, tmp_path, lora=lora)
    spec = SessionSpec(lora_config=LoraConfig(rank=4, train_unembed=train_unembed or False))
    session = resource.create_session("s", spec)
    trainable = session.policy.trainable
    muon, adam = muon_split(trainable)
    layers = 2
    assert set(muon) == _expected_muon(list(trainable), lora)
    assert len(muon) == layers * len(PROJECTIONS) * (2 if lora else 1)
    assert sorted(muon + adam) == sorted(trainable)
    if lora:  # the head's LoRA (train_unembed) is AdamW's; nothing else is trainable
        assert sorted(adam) == sorted(n for n in trainable if ".lm_head." in n)
        assert len(adam) == (2 if train_unembed else 0)
    else:  # embeddings, head, norms (all 1-D but the embedding matrices)
        assert any("embed_tokens" in n for n in adam)
        assert all(trainable[n].ndim == 1 or "embed_tokens" in n or "lm_head" in n for n in adam)
    # the session's optimizer is exactly that split
    groups = session.optimizer.param_groups[0]["params"]
    assert [id(p) for p in groups] == [id(trainable[n]) for n in muon]
    adamw = session.optimizer.adamw
    assert (adamw is None) == (not adam)
    resource.close()


def test_split_on_names_alone() -> None:
    muon, adam = muon_split(
        {
            "model.layers.3.mlp.up_proj.weight": (8, 4),
            "model.layers.3.mlp.up_proj.bias": (8,),
            "model.layers.3.input_layernorm.weight": (4,),
            "model.layers.0.self_attn.q_proj.lora_A.weight": (2, 4),
            "model.embed_tokens.weight": (16, 4),
            "lm_head.weight": (16, 4),
            "lm_head.lora_B.weight": (16, 2),
            "model.layers.1.block_sparse_moe.experts.w1": (2, 8, 4),
        }
    )
    assert muon == [
        "model.layers.3.mlp.up_proj.weight",
        "model.layers.0.self_attn.q_proj.lora_A.weight",
        "model.layers.1.block_sparse_moe.experts.w1",  # a stack of expert matrices
    ]
    assert len(adam) == 5


# -- the update against a float64 reference ---------------------------------------------------


def ns_reference(n: torch.Tensor, steps: int) -> torch.Tensor:
    """Rule 10's quintic Newton–Schulz, in float64."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = n.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / max(float(x.norm()), 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def scale_reference(shape: tuple[int, ...], strategy: str) -> float:
    out, inp = shape
    return 0.2 * math.sqrt(max(out, inp)) if strategy == MATCH else math.sqrt(max(1, out / inp))


@pytest.mark.parametrize(
    ("lora", "strategy", "params", "steps"),
    [
        (True, MATCH, MuonParams(learning_rate=2e-2), 1),
        (True, ORIGINAL, MuonParams(learning_rate=2e-2, grad_clip_norm=0), 3),
        (
            False,
            MATCH,
            MuonParams(
                learning_rate=1e-2,
                momentum=0.8,
                newton_schulz_steps=3,
                weight_decay=0.1,
                grad_clip_norm=0.05,
                adam=AdamParams(learning_rate=3e-3, beta1=0.8, weight_decay=0.05),
            ),
            3,
        ),
        (False, ORIGINAL, MuonParams(learning_rate=1e-2, momentum=0.5, grad_clip_norm=1e6), 1),
    ],
    ids=["lora-match-1", "lora-original-noclip-3", "full-match-knobs-clip-3", "full-original-1"],
)
def test_update_matches_float64_reference(tiny_llama_dir, tmp_path, lora, strategy, params, steps):
    resource = muon_resource(tiny_llama_dir, tmp_path, lora=lora, strategy=strategy)
    session = resource.create_session("s", SessionSpec(lora_config=LoraConfig(rank=4, seed=1)))
    trainable = session.policy.trainable
    muon, adam = muon_split(trainable)
    assert muon and (adam or lora)
    ref_w = {n: trainable[n].detach().double().clone() for n in muon}
    ref_b = {n: torch.zeros_like(w) for n, w in ref_w.items()}
    # the Adam side: torch's own AdamW on copies, fed the same clipped gradients
    copies = {n: torch.nn.Parameter(trainable[n].detach().clone()) for n in adam}
    ref_adam = torch.optim.AdamW(
        list(copies.values()),
        lr=params.adam.learning_rate,
        betas=(params.adam.beta1, params.adam.beta2),
        eps=params.adam.eps,
        weight_decay=params.adam.weight_decay,
    )
    clipped_any = False
    moved = 0
    for t in range(steps):
        session.forward_backward(CE, random_batch(20 + t, n=3, weights="ones"))
        grads = grads_of(session)
        all_grads = [g for g in grads.values() if g is not None]
        norm = float(torch.nn.utils.get_total_norm(all_grads))
        before = weights_of(session)
        out = session.optim_step(muon=params)
        assert out["step"] == t + 1
        assert out["metrics"]["grad_norm"] == pytest.approx(norm, rel=1e-6)
        clip = params.grad_clip_norm
        coef = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
        clipped_any |= coef < 1.0
        after = weights_of(session)
        mu, lr = params.momentum, params.learning_rate
        for n in muon:
            g = grads[n].double() * coef
            ref_b[n] = mu * ref_b[n] + (1 - mu) * g
            update = ns_reference((1 - mu) * g + mu * ref_b[n], params.newton_schulz_steps)
            w = ref_w[n] * (1 - lr * params.weight_decay)
            w = w - lr * scale_reference(tuple(w.shape), strategy) * update
            ref_delta = w - ref_w[n]
            delta = (after[n] - before[n]).double()
            # a LoRA A whose B is still zero has a zero gradient, so a zero update
            err = float((delta - ref_delta).norm())
            assert err <= 3e-2 * float(ref_delta.norm()) + 1e-12, (n, t, err)
            moved += float(ref_delta.norm()) > 0
            ref_w[n] = w
        if adam:
            coef_t = torch.clamp(clip / (torch.tensor(norm) + 1e-6), max=1.0)
            for n in adam:
                copies[n].grad = grads[n].clone().mul_(coef_t) if clip > 0 else grads[n].clone()
            ref_adam.step()
            for n in adam:
                assert torch.equal(after[n], copies[n].detach()), n
    assert moved >= len(muon) // 2 * steps
    assert clipped_any == (params.grad_clip_norm in (1.0, 0.05)), "clip active where meant"
    resource.close()


def test_bf16_matrices_step_through_fp32_masters() -> None:
    """16-bit matrices keep fp32 masters on the Muon side too (as `MasterAdamW` on the AdamW
    side): after each step the master equals the same Muon run on fp32 copies of the first
    weights with the gradients in fp32, bit for bit, and the weight is the master rounded, its
    momentum in fp32. At lr 1e-4 a bf16 Muon alone loses most of its updates."""
    gen = torch.Generator().manual_seed(7)
    shapes = [(32, 16), (16, 48)]
    start = [(torch.randn(s, generator=gen) * 0.05).to(torch.bfloat16) for s in shapes]
    ours, ref, bare = ([torch.nn.Parameter(w.clone()) for w in start] for _ in range(3))
    ref = [torch.nn.Parameter(w.detach().float()) for w in ref]
    knobs = MuonParams(learning_rate=1e-4, weight_decay=0.01)
    optimizers = []
    for params, masters in ((ours, True), (ref, True), (bare, False)):
        optimizers.append(MuonWithAdamW(params, [], MATCH, masters=masters))
        optimizers[-1].set_knobs(knobs)
    direction = [torch.randn(s, generator=gen) for s in shapes]
    for _ in range(20):  # one direction, as a consistent training signal gives
        grads = [
            (g + 0.1 * torch.randn(g.shape, generator=gen)).to(torch.bfloat16) for g in direction
        ]
        for p, r, b, g in zip(ours, ref, bare, grads, strict=True):
            p.grad, r.grad, b.grad = g.clone(), g.float(), g.clone()
        for optimizer in optimizers:
            optimizer.step()
        for p, r in zip(ours, ref, strict=True):
            state = optimizers[0].state[p]
            assert p.dtype == torch.bfloat16 and state["momentum_buffer"].dtype == torch.float32
            assert torch.equal(state[MASTER], r.detach())
            assert torch.equal(p.detach(), r.detach().to(torch.bfloat16))
    moved = sum(int((p.detach() != w).sum()) for p, w in zip(ours, start, strict=True))
    stuck = sum(int((b.detach() != w).sum()) for b, w in zip(bare, start, strict=True))
    assert moved > 5 * stuck, (moved, stuck)
    assert MASTER not in optimizers[2].state[bare[0]]  # `master_weights = false`: none kept


def test_defaults_and_mismatched_params(tiny_qwen_dir, tmp_path) -> None:
    resource = muon_resource(tiny_qwen_dir, tmp_path)
    session = resource.create_session("s", SessionSpec(lora_config=LoraConfig(rank=4)))
    session.forward_backward(CE, random_batch(3, weights="ones"))
    before = weights_of(session)
    with pytest.raises(OperationError) as info:
        session.optim_step(adam=AdamParams())
    assert info.value.code == "INVALID_INPUT" and "adam_params" in str(info.value)
    assert_same(weights_of(session), before)
    assert session.step == 0
    out = session.optim_step()  # no params: §10's defaults
    group = session.optimizer.param_groups[0]
    assert (group["lr"], group["momentum"], group["ns_steps"], group["weight_decay"]) == (
        1e-4,
        0.95,
        5,
        0.0,
    )
    assert group["adjust_lr_fn"] == "match_rms_adamw"
    assert out["metrics"]["grad_norm_clipped"] == min(out["metrics"]["grad_norm"], 1.0)
    adamw = session.optimizer.adamw.param_groups[0]
    assert (adamw["lr"], adamw["betas"], adamw["eps"], adamw["weight_decay"]) == (
        1e-4,
        (0.9, 0.95),
        1e-8,
        0.0,
    )
    resource.close()
    adam_resource = muon_resource(tiny_qwen_dir, tmp_path / "adam", strategy=None)
    plain = adam_resource.create_session("a", SessionSpec())
    with pytest.raises(OperationError) as info:
        plain.optim_step(muon=MuonParams())
    assert "muon_params" in str(info.value)
    adam_resource.close()


def test_params_validation_names_the_field() -> None:
    for bad, field in [
        ({"momentum": 1.0}, "momentum"),
        ({"newton_schulz_steps": 0}, "newton_schulz_steps"),
        ({"newton_schulz_steps": 100}, "newton_schulz_steps"),
        ({"learning_rate": -1}, "learning_rate"),
        ({"adam": {"beta1": 1.0}}, "beta1"),
    ]:
        with pytest.raises(ValueError, match=re.escape(field)):
            MuonParams.model_validate(bad)


# -- checkpoints and resume -------------------------------------------------------------------


def _train(session, steps: range, params: MuonParams) -> list[float]:
    losses = []
    for step in steps:
        out = session.forward_backward(CE, random_batch(100 + step, n=3, weights="ones"))
        session.optim_step(muon=params)
        losses.append(out["loss"])
    return losses


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_resume_is_bit_exact(tiny_qwen_dir, tmp_path, lora) -> None:
    params = MuonParams(learning_rate=2e-2, weight_decay=0.01, adam=AdamParams(learning_rate=1e-2))
    spec = SessionSpec(lora_config=LoraConfig(rank=4, dropout=0.1, seed=5, train_unembed=True))
    straight = muon_resource(tiny_qwen_dir, tmp_path / "store", lora=lora)
    run = straight.create_session("straight", spec)
    uninterrupted = _train(run, range(5), params)
    final = weights_of(run)
    straight.close()

    first = muon_resource(tiny_qwen_dir, tmp_path / "store", lora=lora)
    part = first.create_session("part", spec)
    before = _train(part, range(2), params)
    checkpoint = part.save_training_checkpoint()
    first.close()
    files = [p for p in Path(checkpoint.path).rglob("*.safetensors")]
    keys = set().union(*(load_file(str(f)).keys() for f in files))
    slots = {k.rpartition("::")[2] for k in keys if "::" in k}
    assert {"momentum_buffer", "exp_avg", "exp_avg_sq"} <= slots, slots

    second = muon_resource(tiny_qwen_dir, tmp_path / "store", lora=lora)
    resumed = second.create_session("resumed", SessionSpec(resume_from_checkpoint_id=checkpoint.id))
    assert resumed.step == 2
    after = _train(resumed, range(2, 5), params)
    assert before + after == uninterrupted
    assert_same(weights_of(resumed), final)
    second.close()


def test_resume_across_optimizers_needs_load_optimizer_false(tiny_qwen_dir, tmp_path) -> None:
    """Muon state cannot seed AdamW (nor the reverse): a 4xx naming load_optimizer, and the
    weights alone resume."""
    muon = muon_resource(tiny_qwen_dir, tmp_path / "store")
    session = muon.create_session("m", SessionSpec(lora_config=LoraConfig(rank=4)))
    _train(session, range(1), MuonParams(learning_rate=1e-2))
    checkpoint = session.save_training_checkpoint()
    trained = weights_of(session)
    muon.close()
    adam = muon_resource(tiny_qwen_dir, tmp_path / "store", strategy=None)
    with pytest.raises(OperationError) as info:
        adam.create_session("a", SessionSpec(resume_from_checkpoint_id=checkpoint.id))
    assert info.value.code == "INVALID_INPUT" and "load_optimizer" in str(info.value)
    spec = SessionSpec(resume_from_checkpoint_id=checkpoint.id, load_optimizer=False)
    resumed = adam.create_session("b", spec)
    assert_same(weights_of(resumed), trained)
    resumed.forward_backward(CE, random_batch(1, weights="ones"))
    assert resumed.optim_step(adam=AdamParams())["step"] == 1
    adam.close()


def test_non_finite_gradient_moves_nothing(tiny_llama_dir, tmp_path) -> None:
    """NON_FINITE_LOSS before either side moves: weights, momentum buffers, AdamW moments
    and the step stay as they were."""
    resource = muon_resource(tiny_llama_dir, tmp_path, lora=False)
    session = resource.create_session("s", SessionSpec())
    _train(session, range(1), MuonParams(learning_rate=1e-2))
    session.forward_backward(CE, random_batch(9, weights="ones"))
    name = next(iter(muon_split(session.policy.trainable)[0]))
    session.policy.trainable[name].grad[0, 0] = float("nan")
    weights = weights_of(session)
    state = {k: {s: v.clone() for s, v in st.items()} for k, st in session.optimizer.state.items()}
    with pytest.raises(OperationError) as info:
        session.optim_step(muon=MuonParams(learning_rate=1e-2))
    assert info.value.code == "NON_FINITE_LOSS"
    assert_same(weights_of(session), weights)
    for param, slots in state.items():
        for slot, value in slots.items():
            assert torch.equal(session.optimizer.state[param][slot], value), slot
    assert session.step == 1
    resource.close()
