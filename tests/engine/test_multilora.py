"""Segment-wise multi-adapter LoRA (`trainer.compute.multilora.segmented`) against solo passes.

Adapters are built the way `LoraPolicy` builds sessions (plus one peft adapter on q/v only and
an idle one), with random non-zero B matrices, on the tiny Qwen3 (tied head) and Llama models.
The reference for every position is a plain peft forward of its sample alone with its adapter
active (or with adapters disabled for the base model); gradients are the sum of those solo
backward passes. Tolerances are relative to the largest reference value, fp32 on CPU.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from peft import LoraConfig as PeftLoraConfig

from tests.engine.helpers import random_batch
from trainer.compute.attention import use_packed_sdpa
from trainer.compute.multilora import Segment, lora_layers, segmented
from trainer.compute.policy import LoraPolicy, SharedPeft
from trainer.contract.specs import LoraConfig

TOL = 3e-6  # fp32: a few ulps of summation order (CPUs differ: 1.2e-6 seen on AMD EPYC)
TOL64 = 1e-10  # fp64: rounding is out of the way, any real mismatch is O(1)
# name, rank, alpha, train_unembed (a LoRA on the output head too)
POLICIES = [("s0", 4, 8, True), ("s1", 8, 4, False), ("s2", 2, 16, True), ("s4", 4, 4, True)]
QV = "s3"  # rank 16, alpha 32, on q_proj and v_proj only
IDLE = "s4"  # never given a segment in the gradient test
USED = ["s0", "s1", "s2", QV]


def _load(model_dir: Any) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    use_packed_sdpa(model)
    return model


def _build(
    model_dir: Any,
    dropout: float = 0.0,
    seed: int = 0,
    checkpointing: bool = False,
    dtype: torch.dtype = torch.float32,
) -> tuple[Any, Any]:
    """(peft model, inner transformers model) with the adapters of POLICIES and QV;
    `checkpointing`: activation checkpointing on, as `ModelResource` sets it."""
    model = _load(model_dir)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    holder = SharedPeft()
    for i, (name, rank, alpha, unembed) in enumerate(POLICIES):
        config = LoraConfig(rank=rank, alpha=alpha, dropout=dropout, train_unembed=unembed)
        LoraPolicy(model, holder, name, config, seed=i, with_generator=False)
    peft = holder.model
    qv = PeftLoraConfig(
        r=16, lora_alpha=32, lora_dropout=dropout, target_modules=["q_proj", "v_proj"]
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed + len(POLICIES))  # its lora_A init: the same in every build
        peft.add_adapter(QV, qv)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    peft.to(dtype)
    _all_trainable(peft)
    return peft, peft.base_model.model


def _all_trainable(peft: Any) -> None:
    for name, param in peft.named_parameters():
        param.requires_grad_("lora_" in name)


def _activate(peft: Any, adapter: str) -> None:
    peft.base_model.set_adapter(adapter)
    _all_trainable(peft)  # peft freezes the inactive adapters


def _tokens(seed: int, n: int) -> list[torch.Tensor]:
    return [
        torch.tensor(s.model_input.chunks[0].encoded_text.tokens) for s in random_batch(seed, n=n)
    ]


def _packed(tokens: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    ids = torch.cat(tokens)[None]
    positions = torch.cat([torch.arange(len(t)) for t in tokens])[None]
    return {"input_ids": ids, "position_ids": positions}


def _bounds(tokens: list[torch.Tensor]) -> list[tuple[int, int]]:
    ends = torch.cumsum(torch.tensor([len(t) for t in tokens]), 0).tolist()
    return [(e - len(t), e) for t, e in zip(tokens, ends, strict=True)]


def _solo(
    peft: Any, model: Any, adapter: str | None, tokens: torch.Tensor, parts: Any = None
) -> torch.Tensor:
    """Logits of `tokens` (packed from `parts` if given) alone, with `adapter` active (None:
    adapters disabled, the base model)."""
    inputs = _packed(parts if parts is not None else [tokens])
    if adapter is None:
        with peft.disable_adapter():
            return model(**inputs).logits[0]
    _activate(peft, adapter)
    return model(**inputs).logits[0]


def _runs(owners: list[str]) -> list[tuple[int, int]]:
    """[lo, hi) over the samples: the maximal runs of adjacent samples of one adapter (what
    `segmented` computes with one matmul pair; the solo reference packs them the same way, as
    fp32 sums over 7 or 17 rows differ by more than 1e-6 on these scaled-up models)."""
    runs: list[tuple[int, int]] = []
    for i, owner in enumerate(owners):
        if runs and owners[runs[-1][0]] == owner:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _assert_rel(got: torch.Tensor, want: torch.Tensor, tol: float = TOL) -> None:
    err = float((got - want).abs().max())
    scale = float(want.abs().max())
    assert err <= tol * scale, f"max error {err:.3g} vs scale {scale:.3g}"


def _loss(logits: torch.Tensor, tokens: torch.Tensor, seed: int) -> torch.Tensor:
    """A weighted next-token CE of one sample (weights random but fixed by `seed`)."""
    gen = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, logits.shape[-1], (logits.shape[0],), generator=gen)
    weights = torch.rand(logits.shape[0], generator=gen)
    lp = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
    return -(lp * weights).sum()


def _grads(peft: Any) -> dict[str, torch.Tensor | None]:
    return {
        n: None if p.grad is None else p.grad.clone()
        for n, p in peft.named_parameters()
        if "lora_" in n
    }


def _zero_grads(peft: Any) -> None:
    for param in peft.parameters():
        param.grad = None


def _differs_from_base(
    peft: Any, model: Any, tokens: list[torch.Tensor], owners: list[str]
) -> None:
    """The test can fail: every adapter moves the logits well beyond the tolerance."""
    with torch.no_grad():
        for t, owner in zip(tokens, owners, strict=True):
            base = _solo(peft, model, None, t)
            tuned = _solo(peft, model, owner, t)
            assert float((tuned - base).abs().max()) > 1e-3 * float(base.abs().max()), owner


def test_packed_row_logits_and_grads_equal_solo(tiny_model_dir) -> None:
    _check_packed_row(*_build(tiny_model_dir), backward_inside=True)


def test_packed_row_fp64_exact(tiny_model_dir) -> None:
    """The same in fp64, every gradient tensor to 1e-10: the identity holds exactly, the fp32
    differences above are rounding (a different row count in the base matmuls, another
    summation order)."""
    peft, model = _build(tiny_model_dir, dtype=torch.float64)
    _check_packed_row(peft, model, backward_inside=True, tol=TOL64)


def test_activation_checkpointing_backward_after_exit(tiny_llama_dir) -> None:
    """Checkpointed decoder layers recompute their forward during backward: after the context
    has exited, the recompute still applies each segment's adapter."""
    peft, model = _build(tiny_llama_dir, checkpointing=True)
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    _check_packed_row(peft, model, backward_inside=False)


def _check_packed_row(peft: Any, model: Any, backward_inside: bool, tol: float = TOL) -> None:
    """Logits per sample to `tol` (max error / max value). Gradients: fp32 (`tol` = TOL), per
    adapter, the norm of the difference over all its tensors to `tol` times the norm of its
    solo gradient (single tensors differ by a few ulps more: summation order); fp64, every
    tensor's max error to `tol`."""
    peft.train()
    tokens = _tokens(1, 9)
    # interleaved owners, two adjacent samples of s2 (merged into one run), the idle one absent
    owners = ["s0", "s1", "s2", "s2", QV, "s0", "s1", QV, "s0"]
    _differs_from_base(peft, model, tokens, owners)
    bounds = _bounds(tokens)

    solo_logits: list[torch.Tensor] = []
    for lo, hi in _runs(owners):  # each run of one adapter's adjacent samples, alone
        logits = _solo(peft, model, owners[lo], torch.cat(tokens[lo:hi]), tokens[lo:hi])
        local = _bounds(tokens[lo:hi])
        sum(
            _loss(logits[s:e], tokens[i], seed=i) for i, (s, e) in zip(range(lo, hi), local)
        ).backward()
        solo_logits.extend(logits[s:e].detach() for s, e in local)
    solo_grads = _grads(peft)
    _zero_grads(peft)

    _activate(peft, IDLE)  # the active adapter plays no part inside the context
    segments = [Segment(o, s, e) for o, (s, e) in zip(owners, bounds, strict=True)]
    with segmented(peft, segments):
        logits = model(**_packed(tokens)).logits[0]
        total = sum(
            _loss(logits[s:e], t, seed=i)
            for i, (t, (s, e)) in enumerate(zip(tokens, bounds, strict=True))
        )
        assert isinstance(total, torch.Tensor)
        if backward_inside:
            total.backward()
    if not backward_inside:
        total.backward()
    merged_grads = _grads(peft)

    for (s, e), want in zip(bounds, solo_logits, strict=True):
        _assert_rel(logits[s:e].detach(), want, tol)
    checked = 0
    diff2 = dict.fromkeys(USED, 0.0)
    norm2 = dict.fromkeys(USED, 0.0)
    for name, want in solo_grads.items():
        got = merged_grads[name]
        if f".{IDLE}." in name:
            assert want is None and (got is None or not got.any()), name
            continue
        if want is None:  # the adapter is not on this layer, or the adapter is unused
            assert got is None, name
            continue
        assert got is not None, name
        if tol < TOL:
            _assert_rel(got, want, tol)
        adapter = next(a for a in USED if f".{a}." in name)
        diff2[adapter] += float((got.double() - want.double()).pow(2).sum())
        norm2[adapter] += float(want.double().pow(2).sum())
        checked += 1
    # every used adapter's A and B got gradients on every layer it is on
    assert checked == sum(2 for layer in lora_layers(peft) for a in USED if a in layer.lora_A)
    for adapter in USED:
        assert diff2[adapter] ** 0.5 <= tol * norm2[adapter] ** 0.5, adapter


def test_padded_rows_equal_solo(tiny_model_dir) -> None:
    peft, model = _build(tiny_model_dir)
    tokens = _tokens(2, 4)
    owners = ["s1", QV, "s0", "s2"]
    width = max(len(t) for t in tokens)
    ids = torch.zeros(len(tokens), width, dtype=torch.long)
    mask = torch.zeros(len(tokens), width, dtype=torch.long)
    for b, t in enumerate(tokens):
        ids[b, : len(t)] = t
        mask[b, : len(t)] = 1
    segments = [Segment(o, b * width, (b + 1) * width) for b, o in enumerate(owners)]
    with torch.no_grad():
        with segmented(peft, segments):
            logits = model(input_ids=ids, attention_mask=mask).logits
        for b, (t, owner) in enumerate(zip(tokens, owners, strict=True)):
            _assert_rel(logits[b, : len(t)], _solo(peft, model, owner, t))


def test_positions_outside_segments_are_base(tiny_model_dir) -> None:
    peft, model = _build(tiny_model_dir)
    tokens = _tokens(3, 6)
    bounds = _bounds(tokens)
    owners: list[str | None] = ["s0", None, QV, None, None, None]
    segments = [Segment("s0", *bounds[0]), Segment(QV, *bounds[2]), Segment(None, *bounds[3])]
    _activate(peft, "s1")
    with torch.no_grad():
        with segmented(peft, segments):
            logits = model(**_packed(tokens)).logits[0]
        for (s, e), t, owner in zip(bounds, tokens, owners, strict=True):
            _assert_rel(logits[s:e], _solo(peft, model, owner, t))


def test_context_restores_peft_behaviour(tiny_qwen_dir) -> None:
    peft, model = _build(tiny_qwen_dir)
    tokens = _tokens(4, 3)
    inputs = _packed(tokens)
    n = inputs["input_ids"].shape[1]
    _activate(peft, "s1")
    with torch.no_grad():
        before = model(**inputs).logits
        with pytest.raises(RuntimeError, match="boom"), segmented(peft, [Segment("s0", 0, n)]):
            raise RuntimeError("boom")
        assert torch.equal(model(**inputs).logits, before)

        with segmented(peft, [Segment("s0", 0, n)]):
            outer = model(**inputs).logits
            with segmented(peft, [Segment("s2", 0, n)]):
                inner = model(**inputs).logits
            assert torch.equal(model(**inputs).logits, outer)
        assert torch.equal(model(**inputs).logits, before)
        _activate(peft, "s0")
        _assert_rel(outer, model(**inputs).logits)
        _activate(peft, "s2")
        _assert_rel(inner, model(**inputs).logits)
        assert not torch.equal(outer, inner)

        # an error inside the forward (a segment past the input) also restores everything
        _activate(peft, "s1")
        with (
            pytest.raises(ValueError, match="reach position"),
            segmented(peft, [Segment("s0", 0, n + 1)]),
        ):
            model(**inputs)
        assert torch.equal(model(**inputs).logits, before)
    assert all("forward" not in layer.__dict__ for layer in lora_layers(peft))


def test_refusals(tiny_llama_dir) -> None:
    peft, model = _build(tiny_llama_dir)
    with (
        pytest.raises(ValueError, match="overlap"),
        segmented(peft, [Segment("s0", 0, 5), Segment("s1", 4, 8)]),
    ):
        pass
    with pytest.raises(ValueError, match="bad range"), segmented(peft, [Segment("s0", 5, 4)]):
        pass
    with (
        pytest.raises(ValueError, match="no LoRA layer holds"),
        segmented(peft, [Segment("nope", 0, 4)]),
    ):
        pass
    peft.add_adapter("dora", PeftLoraConfig(r=4, use_dora=True, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="DoRA"), segmented(peft, [Segment("dora", 0, 4)]):
        pass
    # an adapter never named in the segments may be anything: here DoRA computes nothing
    tokens = _tokens(5, 2)
    with torch.no_grad(), segmented(peft, [Segment("s0", 0, len(tokens[0]))]):
        logits = model(**_packed(tokens[:1])).logits[0]
    with torch.no_grad():
        _assert_rel(logits, _solo(peft, model, "s0", tokens[0]))
    assert all("forward" not in layer.__dict__ for layer in lora_layers(peft))


def test_dropout_per_adapter_generators_match_solo_streams(tiny_qwen_dir) -> None:
    """With `generators`, each adapter's masks come from its own stream: an adapter whose
    samples form one run sees the masks of a solo packed pass from the same RNG state."""
    peft, model = _build(tiny_qwen_dir, dropout=0.3)
    peft.train()
    tokens = _tokens(6, 6)
    owners = ["s0", "s0", "s0", QV, QV, QV]
    bounds = _bounds(tokens)
    seeds = {"s0": 11, QV: 22}
    generators = {a: torch.Generator().manual_seed(s) for a, s in seeds.items()}
    segments = [Segment(o, s, e) for o, (s, e) in zip(owners, bounds, strict=True)]
    with torch.no_grad():
        torch.manual_seed(99)
        with segmented(peft, segments, generators=generators):
            logits = model(**_packed(tokens)).logits[0]
        for adapter, (lo, hi) in (("s0", (0, 3)), (QV, (3, 6))):
            start, end = bounds[lo][0], bounds[hi - 1][1]
            _activate(peft, adapter)
            torch.manual_seed(seeds[adapter])
            solo = model(**_packed(tokens[lo:hi])).logits[0]
            _assert_rel(logits[start:end], solo)
            torch.manual_seed(seeds[adapter] + 1)  # control: other masks, other logits
            other = model(**_packed(tokens[lo:hi])).logits[0]
            assert float((other - solo).abs().max()) > 1e-3 * float(solo.abs().max())


def test_dropout_generators_replayed_by_activation_checkpointing(tiny_llama_dir) -> None:
    """A checkpointed layer's recompute (backward after the context exited) replays each
    adapter's generator from its state at the first run, so the gradients are those of the
    same pass without checkpointing, and the generators end where that pass leaves them."""
    owners = ["s0", "s1", QV, "s0"]
    tokens = _tokens(7, len(owners))
    segments = [Segment(o, s, e) for o, (s, e) in zip(owners, _bounds(tokens), strict=True)]
    results = []
    for checkpointing in (False, True):
        peft, model = _build(tiny_llama_dir, dropout=0.3, checkpointing=checkpointing)
        peft.train()
        generators = {a: torch.Generator().manual_seed(i) for i, a in enumerate(USED)}
        with segmented(peft, segments, generators=generators):
            logits = model(**_packed(tokens)).logits[0]
        _loss(logits, torch.cat(tokens), seed=0).backward()
        states = {a: g.get_state() for a, g in generators.items()}
        results.append((logits.detach(), _grads(peft), states))
    (plain, plain_grads, plain_states), (ckpt, ckpt_grads, ckpt_states) = results
    _assert_rel(ckpt, plain)
    for name, want in plain_grads.items():
        got = ckpt_grads[name]
        assert (got is None) == (want is None), name
        if want is not None and got is not None:
            _assert_rel(got, want)
    assert all(torch.equal(ckpt_states[a], plain_states[a]) for a in USED)
