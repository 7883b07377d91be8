"""LoRA on a mixture-of-experts base, on a tiny Qwen3-MoE built from a config.

transformers 5 keeps each MoE block's experts as two fused 3-D parameters
(`experts.gate_up_proj` (experts, 2·moe_inter, hidden), `experts.down_proj` (experts, hidden,
moe_inter)) beside a router module (`mlp.gate`). A LoRA session adapts them with per-expert
low-rank factors through peft's `target_parameters` (its `ParamWrapper`); the router is not
adapted, and a dense model keeps exactly the module targets. Checked against independent
references written here: plain transformers / peft reloads of the exports, the merged expert
weights recomputed in plain torch from the adapter's factors, and Muon's per-expert update in
float64 (docs/semantics.md §10).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.engine import test_merge as merge_tests
from tests.engine.helpers import assert_same, grads_of, make_resource, random_batch, weights_of
from tests.engine.test_muon import MATCH, ORIGINAL, muon_resource, ns_reference, scale_reference
from trainer.compute.lora_targets import lora_target_parameters, peft_lora_config
from trainer.compute.muon import muon_split
from trainer.contract.errors import OperationError
from trainer.contract.muon_params import MuonParams
from trainer.contract.options import EngineOptions
from trainer.contract.specs import AdamParams, LoraConfig, LossConfig, SessionSpec

CE = LossConfig(type="cross_entropy")
EXPERTS, TOP_K, HIDDEN, MOE_INTER, LAYERS = 4, 2, 64, 48, 2
STACKS = ["experts.down_proj", "experts.gate_up_proj"]
TOKENS = [3, 17, 29, 4, 88, 61, 12, 40, 7]


def _worker_logprobs(session, tokens: list[int]) -> torch.Tensor:
    """The worker's own forward operation: logprobs of tokens[1:] after tokens[:-1]."""
    from tests.engine.helpers import sample

    out = session.forward_backward(
        CE,
        [sample(tokens[:-1], tokens[1:], weights=[1.0] * (len(tokens) - 1))],
        forward_only=True,
        return_loss_fn_outputs=True,
    )
    return torch.tensor(out["loss_fn_outputs"][0]["tensors"]["logprobs"]["data"])


def _reference_logprobs(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens[:-1]])).logits[0].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]


def _train(session, steps: range, **step) -> list[float]:
    losses = []
    for k in steps:
        out = session.forward_backward(CE, random_batch(100 + k, n=3, weights="ones"))
        session.optim_step(**step)
        losses.append(out["loss"])
    return losses


# -- targets -----------------------------------------------------------------------------------


def test_targets_experts_not_router_and_dense_unchanged(tiny_moe_dir, tiny_qwen_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(tiny_qwen_dir)
    assert lora_target_parameters(dense) == []
    dense_config = peft_lora_config(dense, LoraConfig(rank=4))
    assert not dense_config.target_parameters  # the module-only config for dense models
    assert sorted(dense_config.target_modules) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    )

    resource = make_resource(tiny_moe_dir, tmp_path)
    moe = resource.model
    assert lora_target_parameters(moe) == STACKS
    session = resource.create_session("a", SessionSpec(lora_config=LoraConfig(rank=4, seed=1)))
    trainable = session.policy.trainable
    assert not any(".mlp.gate." in n for n in trainable), "the router is not adapted"
    for layer in range(LAYERS):
        prefix = f"base_model.model.model.layers.{layer}.mlp.experts."
        shapes = sorted(tuple(p.shape) for n, p in trainable.items() if n.startswith(prefix))
        # per-expert rank-4 factors: gate_up (E·r, hidden) and (2·inter, r·E), down likewise
        assert shapes == sorted(
            [
                (EXPERTS * 4, HIDDEN),
                (2 * MOE_INTER, 4 * EXPERTS),
                (EXPERTS * 4, MOE_INTER),
                (HIDDEN, 4 * EXPERTS),
            ]
        )
    assert set(session.policy.expert_factors.values()) == {EXPERTS}
    assert len(session.policy.expert_factors) == 4 * LAYERS
    # a second session (another rank) gets its own factors on the same fused parameters
    other = resource.create_session("b", SessionSpec(lora_config=LoraConfig(rank=2, seed=2)))
    assert len(other.policy.expert_factors) == 4 * LAYERS
    # closing one session removes its factors and leaves the other's computation as it was
    before = _worker_logprobs(session, TOKENS)
    resource.close_session("b")
    wrappers = [m for m in resource.model.modules() if hasattr(m, "parameter_name")]
    assert len(wrappers) == 2 * LAYERS
    assert all(sorted(m.lora_A) == sorted(["s1", "s1p"]) for m in wrappers)
    assert torch.equal(_worker_logprobs(session, TOKENS), before)
    resource.close()


def test_activation_checkpointing_gives_the_same_gradients(tiny_moe_dir, tmp_path) -> None:
    grads = []
    for checkpointing in (False, True):
        options = EngineOptions(activation_checkpointing=checkpointing)
        resource = make_resource(tiny_moe_dir, tmp_path / str(checkpointing), options=options)
        spec = SessionSpec(lora_config=LoraConfig(rank=4, seed=1))
        session = resource.create_session("a", spec)
        _train(session, range(1), adam=AdamParams(learning_rate=5e-2))  # B ≠ 0: A gets grads
        session.forward_backward(CE, random_batch(7, n=3, weights="ones"))
        grads.append(grads_of(session))
        resource.close()
    experts = [n for n in grads[0] if ".mlp.experts." in n]
    assert experts and all(float(grads[0][n].norm()) > 0 for n in experts)
    for name, want in grads[0].items():
        torch.testing.assert_close(grads[1][name], want, atol=1e-6, rtol=1e-5)


def test_dropout_on_moe_is_refused_without_trace(tiny_moe_dir, tmp_path) -> None:
    resource = make_resource(tiny_moe_dir, tmp_path)
    session = resource.create_session("a", SessionSpec(lora_config=LoraConfig(rank=4, seed=1)))
    adapters = sorted(resource.peft.model.peft_config)
    with pytest.raises(OperationError) as err:
        resource.create_session("b", SessionSpec(lora_config=LoraConfig(rank=4, dropout=0.1)))
    assert err.value.code == "INVALID_INPUT" and err.value.field == "lora_config.dropout"
    assert sorted(resource.peft.model.peft_config) == adapters
    assert "b" not in resource.sessions
    _train(session, range(1), adam=AdamParams(learning_rate=1e-2))  # the resource still works
    resource.close()


# -- base, sampling, isolation ----------------------------------------------------------------


def test_step0_logprobs_and_sampling_match_transformers(tiny_moe_dir, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    from tests.engine.helpers import model_input
    from trainer.contract.specs import SamplingParams

    base = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32).eval()
    for lora in (True, False):
        resource = make_resource(tiny_moe_dir, tmp_path / str(lora), lora=lora)
        session = resource.create_session("a", SessionSpec(lora_config=LoraConfig(rank=4)))
        want = _reference_logprobs(base, TOKENS)
        torch.testing.assert_close(_worker_logprobs(session, TOKENS), want, atol=1e-5, rtol=0)
        params = SamplingParams(max_tokens=6, temperature=1.0, seed=3)
        out = session.sample([model_input(TOKENS[:3])], num_samples=2, sampling_params=params)
        for seq in out["results"][0]["sequences"]:
            full = TOKENS[:3] + list(seq["tokens"])
            ref = _reference_logprobs(base, full)[2:]
            got = torch.tensor(seq["logprobs"])
            assert len(seq["tokens"]) >= 1
            torch.testing.assert_close(got, ref[: len(got)], atol=1e-4, rtol=0)
        resource.close()


# -- exports -----------------------------------------------------------------------------------


def _expert_delta_reference(adapter: dict[str, torch.Tensor], module: str, scale: float):
    """{stack name: (experts, out, in) delta} from the adapter's factors, in plain torch:
    expert e's delta is scale · B_e @ A_e with A_e the rows e·r… of lora_A and B_e the columns
    e, e+E, … of lora_B (peft's ParamWrapper layout). The stack is told by its out size."""
    out: dict[str, torch.Tensor] = {}
    for key, a in adapter.items():
        if not (key.startswith(module) and key.endswith("lora_A.weight")):
            continue
        b = adapter[key.replace("lora_A", "lora_B")].double()
        a = a.double()
        rank = a.shape[0] // EXPERTS
        delta = torch.stack(
            [
                scale * b[:, [k * EXPERTS + e for k in range(rank)]] @ a[e * rank : (e + 1) * rank]
                for e in range(EXPERTS)
            ]
        )
        out["gate_up_proj" if delta.shape[1] == 2 * MOE_INTER else "down_proj"] = delta
    return out


def test_expert_lora_exports_reload_and_move_the_experts(tiny_moe_dir, tmp_path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    resource = make_resource(tiny_moe_dir, tmp_path)
    config = LoraConfig(rank=4, alpha=8, seed=1)
    session = resource.create_session("a", SessionSpec(lora_config=config))
    _train(session, range(3), adam=AdamParams(learning_rate=5e-2))
    expected = _worker_logprobs(session, TOKENS)
    checkpoint = session.save_inference_checkpoint()

    adapter_dir = checkpoint.path / "adapter"
    adapter = load_file(str(adapter_dir / "adapter_model.safetensors"))
    assert all("lora_" in key for key in adapter), "no base weights inside the adapter"
    expert_keys = [k for k in adapter if ".mlp.experts." in k]
    assert len(expert_keys) == 4 * LAYERS, "both stacks' A and B in every layer"
    assert not any(".mlp.gate." in k for k in adapter)

    base = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32)
    base_weights = {n: p.detach().clone() for n, p in base.named_parameters()}
    peft_model = PeftModel.from_pretrained(base, adapter_dir).eval()
    torch.testing.assert_close(_reference_logprobs(peft_model, TOKENS), expected, atol=1e-5, rtol=0)

    merged = AutoModelForCausalLM.from_pretrained(checkpoint.path / "merged", dtype=torch.float32)
    merged = merged.eval()
    torch.testing.assert_close(_reference_logprobs(merged, TOKENS), expected, atol=1e-5, rtol=0)
    weights = dict(merged.named_parameters())
    for layer in range(LAYERS):
        module = f"base_model.model.model.layers.{layer}.mlp.experts."
        deltas = _expert_delta_reference(adapter, module, config.alpha / config.rank)
        assert sorted(deltas) == ["down_proj", "gate_up_proj"]
        for stack, delta in deltas.items():
            name = f"model.layers.{layer}.mlp.experts.{stack}"
            moved = weights[name].detach().double() - base_weights[name].double()
            assert float(moved.abs().max()) > 1e-3, f"{name} did not move"
            torch.testing.assert_close(moved, delta, atol=1e-5, rtol=1e-5)
            for e in range(EXPERTS):  # every expert got its own update
                assert float(moved[e].abs().max()) > 1e-4, (name, e)
        router = f"model.layers.{layer}.mlp.gate.weight"
        assert torch.equal(weights[router], base_weights[router]), "the router is not adapted"
    # the base in memory was never merged into
    live = {n.replace(".base_layer", ""): p for n, p in resource.model.named_parameters()}
    for name, param in base_weights.items():
        assert torch.equal(live[name], param), name
    resource.close()
    # a full-weight session starts from the adapter merged into the base, experts included
    full = make_resource(tiny_moe_dir, tmp_path / "full", lora=False)
    spec = SessionSpec(resume_from_hf_checkpoint=str(adapter_dir))
    session = full.create_session("f", spec)
    torch.testing.assert_close(_worker_logprobs(session, TOKENS), expected, atol=1e-5, rtol=0)
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        torch.testing.assert_close(
            session.policy.trainable[name].detach(), weights[name].detach(), atol=1e-6, rtol=0
        )
    full.close()
    # and a LoRA session resumes from the adapter as it is
    again = make_resource(tiny_moe_dir, tmp_path / "again")
    session = again.create_session("l", spec)
    torch.testing.assert_close(_worker_logprobs(session, TOKENS), expected, atol=1e-6, rtol=0)
    again.close()


def test_full_weight_export_reloads_with_trained_experts(tiny_moe_dir, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    resource = make_resource(tiny_moe_dir, tmp_path, lora=False)
    session = resource.create_session("f", SessionSpec())
    _train(session, range(2), adam=AdamParams(learning_rate=1e-2))
    expected = _worker_logprobs(session, TOKENS)
    checkpoint = session.save_inference_checkpoint()
    resource.close()
    merged = AutoModelForCausalLM.from_pretrained(checkpoint.path / "merged", dtype=torch.float32)
    torch.testing.assert_close(
        _reference_logprobs(merged.eval(), TOKENS), expected, atol=1e-5, rtol=0
    )
    base = dict(AutoModelForCausalLM.from_pretrained(tiny_moe_dir).named_parameters())
    for name, param in merged.named_parameters():
        if ".mlp." in name:  # experts and router: full weights train everything
            assert not torch.equal(param, base[name]), name


# -- Muon per expert (docs/semantics.md §10) ---------------------------------------------------


@pytest.mark.parametrize(("lora", "strategy"), [(True, MATCH), (False, ORIGINAL)])
def test_muon_orthogonalises_each_expert(tiny_moe_dir, tmp_path, lora, strategy) -> None:
    resource = muon_resource(tiny_moe_dir, tmp_path, lora=lora, strategy=strategy)
    session = resource.create_session("s", SessionSpec(lora_config=LoraConfig(rank=4, seed=1)))
    trainable = session.policy.trainable
    muon, _ = muon_split(trainable)
    experts = {n for n in muon if ".mlp.experts." in n}
    assert len(experts) == (4 if lora else 2) * LAYERS, "expert tensors go to Muon"
    params = MuonParams(learning_rate=2e-2, momentum=0.5, grad_clip_norm=0)
    bufs = {n: torch.zeros_like(trainable[n], dtype=torch.float64) for n in experts}
    checked = 0
    for t in range(2):
        session.forward_backward(CE, random_batch(20 + t, n=3, weights="ones"))
        grads = grads_of(session)
        before = weights_of(session)
        session.optim_step(muon=params)
        after = weights_of(session)
        for n in sorted(experts):
            g = grads[n].double()
            bufs[n] = 0.5 * bufs[n] + 0.5 * g
            upd = 0.5 * g + 0.5 * bufs[n]
            if lora and ".lora_A." in n:  # (E·r, in): expert e owns rows e·r…
                mats = list(upd.reshape(EXPERTS, -1, upd.shape[-1]))
            elif lora:  # (out, r·E): expert e owns columns e, e+E, …
                mats = [upd[:, e::EXPERTS] for e in range(EXPERTS)]
            else:  # (E, out, in)
                mats = list(upd)
            ref = [
                -2e-2 * scale_reference(tuple(m.shape), strategy) * ns_reference(m, 5) for m in mats
            ]
            delta = (after[n] - before[n]).double()
            if lora and ".lora_A." in n:
                got = list(delta.reshape(EXPERTS, -1, delta.shape[-1]))
            elif lora:
                got = [delta[:, e::EXPERTS] for e in range(EXPERTS)]
            else:
                got = list(delta)
            for e, (d, r) in enumerate(zip(got, ref, strict=True)):
                if float(r.norm()) == 0:  # a LoRA A whose B is still zero: no update
                    assert float(d.norm()) == 0
                    continue
                err = float((d - r).norm())
                assert err <= 3e-2 * float(r.norm()), (n, t, e, err)
                checked += 1
            # one Newton–Schulz over the whole tensor would be another update (the test bites)
            if lora and float(upd.norm()) > 0:
                whole = -2e-2 * scale_reference(tuple(upd.shape), strategy) * ns_reference(upd, 5)
                assert float((delta - whole).norm()) > 0.1 * float(whole.norm()), n
    assert checked >= EXPERTS * len(experts), checked
    resource.close()


# -- training checkpoints ------------------------------------------------------------------------


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_training_checkpoint_resumes_bit_exactly(tiny_moe_dir, tmp_path, lora) -> None:
    params = MuonParams(learning_rate=2e-2, weight_decay=0.01, adam=AdamParams(learning_rate=1e-2))
    spec = SessionSpec(lora_config=LoraConfig(rank=4, seed=5))
    straight = muon_resource(tiny_moe_dir, tmp_path / "store", lora=lora)
    run = straight.create_session("straight", spec)
    uninterrupted = _train(run, range(4), muon=params)
    final = weights_of(run)
    straight.close()

    first = muon_resource(tiny_moe_dir, tmp_path / "store", lora=lora)
    part = first.create_session("part", spec)
    before = _train(part, range(2), muon=params)
    checkpoint = part.save_training_checkpoint()
    first.close()
    keys = set().union(
        *(load_file(str(f)).keys() for f in Path(checkpoint.path).rglob("*.safetensors"))
    )
    assert any(".mlp.experts." in k and "momentum_buffer" in k for k in keys), "expert state"

    second = muon_resource(tiny_moe_dir, tmp_path / "store", lora=lora)
    resumed = second.create_session("resumed", SessionSpec(resume_from_checkpoint_id=checkpoint.id))
    after = _train(resumed, range(2, 4), muon=params)
    assert before + after == uninterrupted
    assert_same(weights_of(resumed), final)
    second.close()


# -- concurrent sessions -------------------------------------------------------------------------


def test_moe_sessions_run_alone_and_equal_solo(tiny_moe_dir, tiny_qwen_dir, tmp_path) -> None:
    """`segmented` (merged passes, batched samples) handles module layers only: MoE LoRA
    sessions run alone, and their concurrent calls equal a solo run."""
    from trainer.engine.batching.sample_batch import batcher_for

    configs = [LoraConfig(rank=4, alpha=8, seed=11), LoraConfig(rank=8, alpha=32, seed=12)]
    plans = [merge_tests._plan(kind) for kind in (0, 3)]
    reference = make_resource(tiny_moe_dir, tmp_path / "solo", options=merge_tests.SOLO)
    want = merge_tests._solo(reference, plans, configs)
    reference.close()

    merging = EngineOptions(merge_window_ms=50.0)
    resource = make_resource(tiny_moe_dir, tmp_path / "merged", options=merging)
    got = merge_tests._concurrent(resource, plans, configs)
    for s, (records, refs) in enumerate(zip(got, want, strict=True)):
        for k, (record, ref) in enumerate(zip(records, refs, strict=True)):
            merge_tests._compare(record, ref, f"session {s} op {k}")
    assert resource.scheduler.counters()["merged_passes"] == 0
    sessions = list(resource.sessions.values())
    assert all(not s.policy.segmentable for s in sessions)
    assert all(batcher_for(s) is None for s in sessions)
    resource.close()
    dense = make_resource(tiny_qwen_dir, tmp_path / "dense", options=merging)
    pair = [
        dense.create_session(f"d{i}", SessionSpec(lora_config=c)) for i, c in enumerate(configs)
    ]
    assert all(s.policy.segmentable and batcher_for(s) is not None for s in pair)
    dense.close()
