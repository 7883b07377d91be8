"""`trainer/compute/optim.py` in one process equals torch's own norm and clipping, bit for bit."""

from __future__ import annotations

import pytest
import torch

from tests.engine.helpers import make_resource, random_batch
from trainer.compute import optim
from trainer.compute.placement import Solo
from trainer.contract.errors import OperationError
from trainer.contract.options import EngineOptions
from trainer.contract.specs import AdamParams, Gradient, LossConfig, SessionSpec


def _params(seed: int, scale: float = 1.0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = []
    for shape in [(7, 5), (5,), (3, 3, 2)]:
        p = torch.nn.Parameter(torch.randn(shape, generator=gen))
        p.grad = torch.randn(shape, generator=gen) * scale
        params.append(p)
    return params


def test_grad_norm_and_clipping_equal_torch() -> None:
    ours, ref = _params(0, scale=10.0), _params(0, scale=10.0)
    grads = [p.grad for p in ours if p.grad is not None]
    norm = optim.grad_norm(grads, Solo())
    expected = torch.nn.utils.get_total_norm([p.grad for p in ref if p.grad is not None])
    assert norm == float(expected)
    optim.clip_grads_(grads, 1.5, norm)
    torch.nn.utils.clip_grads_with_norm_(ref, 1.5, torch.tensor(norm))
    for a, b in zip(ours, ref, strict=True):
        assert torch.equal(a.grad, b.grad)


def test_adamw_step_equals_torch_adamw_and_refuses_a_non_finite_norm() -> None:
    ours, ref = _params(1), _params(1)
    adam = AdamParams(learning_rate=1e-2, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.1)
    metrics = optim.adamw_step(optim.new_adamw(ours), ours, adam, Solo())
    norm = float(torch.nn.utils.get_total_norm([p.grad for p in ref if p.grad is not None]))
    assert norm > adam.grad_clip_norm == 1.0  # the default clips
    torch.nn.utils.clip_grads_with_norm_(ref, 1.0, torch.tensor(norm))
    torch.optim.AdamW(ref, lr=1e-2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1).step()
    assert metrics == {"grad_norm": norm, "grad_norm_clipped": 1.0, "learning_rate": 1e-2}
    for a, b in zip(ours, ref, strict=True):
        assert torch.equal(a.detach(), b.detach()) and a.grad is None
    bad = _params(2)
    assert bad[0].grad is not None
    bad[0].grad[0, 0] = float("inf")
    before = [p.detach().clone() for p in bad]
    with pytest.raises(OperationError) as err:
        optim.adamw_step(optim.new_adamw(bad), bad, adam, Solo())
    assert err.value.code == "NON_FINITE_LOSS"
    assert all(torch.equal(p.detach(), b) for p, b in zip(bad, before, strict=True))


def test_bf16_weights_step_through_fp32_masters() -> None:
    """16-bit weights (full weights on CUDA) keep fp32 masters: after each step the weight is
    its master rounded, and the master equals torch's AdamW run in fp32 on fp32 copies of the
    first weights with the gradients in fp32. At lr 1e-5 a bf16 AdamW alone would not move
    them at all; the masters' steps add up and show in the weights."""
    gen = torch.Generator().manual_seed(5)
    shapes = [(64, 32), (32,)]
    start = [torch.randn(s, generator=gen) * 0.05 for s in shapes]
    ours = [torch.nn.Parameter(w.to(torch.bfloat16)) for w in start]
    masters = [torch.nn.Parameter(w.to(torch.bfloat16).float()) for w in start]
    plain = [torch.nn.Parameter(w.to(torch.bfloat16)) for w in start]  # bf16 AdamW, no masters
    adam = AdamParams(learning_rate=1e-5, weight_decay=0.01, grad_clip_norm=0.0)
    opt = optim.new_adamw(ours)
    ref = torch.optim.AdamW(masters, lr=1e-5, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    bare = torch.optim.AdamW(plain, lr=1e-5, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    direction = [torch.randn(s, generator=gen).to(torch.bfloat16) for s in shapes]
    for _ in range(20):  # one gradient direction, as a consistent training signal gives
        grads = [g * (1 + 0.1 * torch.randn(g.shape, generator=gen)) for g in direction]
        grads = [g.to(torch.bfloat16) for g in grads]
        for p, m, q, g in zip(ours, masters, plain, grads, strict=True):
            p.grad, m.grad, q.grad = g.clone(), g.float(), g.clone()
        optim.adamw_step(opt, ours, adam, Solo())
        ref.step()
        bare.step()
        for p, m in zip(ours, masters, strict=True):
            assert p.dtype == torch.bfloat16
            assert torch.equal(opt.state[p][optim.MASTER], m.detach())
            assert torch.equal(p.detach(), m.detach().to(torch.bfloat16))
            assert opt.state[p]["exp_avg"].dtype == torch.float32
    first = [w.to(torch.bfloat16) for w in start]
    moved = sum(int((p.detach() != w).sum()) for p, w in zip(ours, first, strict=True))
    stuck = sum(int((q.detach() != w).sum()) for q, w in zip(plain, first, strict=True))
    assert moved > 5 * stuck, (moved, stuck)  # bf16 AdamW alone loses most updates
    ours_off = sum(
        float((p.detach().float() - m.detach()).abs().sum()) for p, m in zip(ours, masters)
    )
    plain_off = sum(
        float((q.detach().float() - m.detach()).abs().sum()) for q, m in zip(plain, masters)
    )
    assert plain_off > 2 * ours_off, (plain_off, ours_off)
    # the masters travel with the rest of the state (a checkpoint's optimizer tensors)
    named = {f"w{i}": p for i, p in enumerate(ours)}
    saved = optim.state_tensors(opt, named)
    assert saved["w0::master"].dtype == torch.float32
    fresh = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    again = optim.new_adamw(fresh)
    optim.load_state_tensors(again, {f"w{i}": p for i, p in enumerate(fresh)}, saved)
    assert torch.equal(again.state[fresh[0]][optim.MASTER], opt.state[ours[0]][optim.MASTER])


def test_bf16_gradients_add_up_in_fp32() -> None:
    """With masters, each call's bf16 gradient of a 16-bit weight moves into an fp32 sum
    (`accumulate_`), so a large call does not swallow the small ones after it as a bf16 sum
    would. The step takes the sums, scaled and clipped, as torch's AdamW on fp32 copies takes
    them; a step refused as non-finite leaves the sums as they were, unscaled."""
    gen = torch.Generator().manual_seed(11)
    shapes = [(64, 32), (32,)]
    start = [(torch.randn(s, generator=gen) * 0.05).to(torch.bfloat16) for s in shapes]
    ours = [torch.nn.Parameter(w.clone()) for w in start]
    masters = [torch.nn.Parameter(w.float()) for w in start]
    opt = optim.new_adamw(ours)
    # one large call, then 15 small ones: 1e-3 is below half of bf16's step at 1
    calls = [[torch.randn(s, generator=gen) for s in shapes]]
    calls += [[torch.randn(s, generator=gen) * 1e-3 for s in shapes] for _ in range(15)]
    calls = [[g.to(torch.bfloat16) for g in call] for call in calls]
    for call in calls:
        for p, g in zip(ours, call, strict=True):
            p.grad = g.clone()
        optim.accumulate_(opt, ours)
        assert all(p.grad is None for p in ours)
    want = []
    for i in range(len(shapes)):
        total, rounded = calls[0][i].float(), calls[0][i].clone()
        for call in calls[1:]:
            total, rounded = total + call[i].float(), rounded + call[i]
        want.append(total)
        assert not torch.equal(rounded.float(), total)  # a bf16 sum would lose the small calls
    sums = optim.wide_grads(opt)
    assert sums is not None
    for p, w in zip(ours, want, strict=True):
        assert torch.equal(sums[p], w)

    adam = AdamParams(learning_rate=1e-4, weight_decay=0.01, grad_clip_norm=0.5)
    scale = 1 / len(calls)
    sums[ours[1]][0] = float("inf")
    with pytest.raises(OperationError) as err:
        optim.adamw_step(opt, ours, adam, Solo(), grad_scale=scale)
    assert err.value.code == "NON_FINITE_LOSS"
    assert torch.isinf(sums[ours[1]][0]) and torch.equal(sums[ours[0]], want[0])  # unscaled
    assert torch.equal(sums[ours[1]][1:], want[1][1:]) and not opt.state
    sums[ours[1]][0] = want[1][0]

    metrics = optim.adamw_step(opt, ours, adam, Solo(), grad_scale=scale)
    for m, w in zip(masters, want, strict=True):
        m.grad = w * scale
    norm = torch.nn.utils.get_total_norm([m.grad for m in masters if m.grad is not None])
    assert metrics["grad_norm"] == float(norm) > 0.5  # the clip is active
    torch.nn.utils.clip_grads_with_norm_(masters, 0.5, norm)
    torch.optim.AdamW(masters, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01).step()
    for p, m in zip(ours, masters, strict=True):
        assert torch.equal(opt.state[p][optim.MASTER], m.detach())
        assert torch.equal(p.detach(), m.detach().to(torch.bfloat16))
    assert not sums  # the step consumed them


CE = LossConfig(type="cross_entropy")


def _bf16_session(model_dir, tmp_path, options: EngineOptions | None = None):
    """A bf16 full-weight session on `model_dir`, its weights and its optimizer's fp32 sums."""
    resource = make_resource(
        model_dir, tmp_path, lora=False, generator=False, dtype="bfloat16", options=options
    )
    session = resource.create_session("s", SessionSpec())
    params = list(session.policy.trainable.values())
    assert params and all(p.dtype == torch.bfloat16 for p in params)
    sums = optim.wide_grads(session.optimizer)
    assert sums is not None
    return resource, session, params, sums


def _each_alone(session, params, sums, batches) -> list[dict]:
    """Each batch's gradient as a call of its own (widened), the sums cleared after each."""
    alone = []
    for batch in batches:
        session.forward_backward(CE, batch)
        assert all(p.grad is None for p in params)  # widened into the sums
        alone.append({p: sums[p].clone() for p in params})
        session.optimizer.zero_grad()
    return alone


def _assert_fp32_sum(sums, alone, params) -> None:
    """`sums` is `alone` added in order in fp32; the same added in bf16 would differ."""
    rounded = 0
    for p in params:
        want, narrow = alone[0][p], alone[0][p].to(torch.bfloat16)
        for part in alone[1:]:
            want, narrow = want + part[p], narrow + part[p].to(torch.bfloat16)
        assert torch.equal(sums[p], want)
        rounded += int((narrow.float() != want).sum())
    assert rounded > 0  # a bf16 sum would have rounded some of them


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_bf16_full_weights_sum_their_calls_in_fp32(family, tiny_qwen_dir, tiny_llama_dir, tmp_path):
    """A bf16 full-weight session: its gradients over four forward-backward calls are the
    fp32 sum of each call's gradient (the call run alone, widened); a call refused as
    non-finite in between adds nothing; the step consumes the sums."""
    model_dir = tiny_qwen_dir if family == "qwen3" else tiny_llama_dir
    resource, session, params, sums = _bf16_session(model_dir, tmp_path)
    batches = [random_batch(50 + k, n=3, weights="ones") for k in range(4)]
    alone = _each_alone(session, params, sums, batches)
    for k, batch in enumerate(batches):
        session.forward_backward(CE, batch)
        if k == 1:
            bad = random_batch(60, n=2)
            grads = [Gradient(data=[3e38] * len(s.model_input.tokens)) for s in bad]
            with pytest.raises(OperationError) as info:
                session.custom_forward_backward(bad, grads)
            assert info.value.code == "NON_FINITE_LOSS"
    _assert_fp32_sum(sums, alone, params)
    assert session.optim_step(AdamParams(learning_rate=1e-3))["metrics"]["grad_norm"] > 0
    assert not sums
    resource.close()


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_bf16_micro_batches_sum_in_fp32(family, tiny_qwen_dir, tiny_llama_dir, tmp_path):
    """Within one call too: a call of four 16-token rows runs as four micro-batches of one row
    (`token_budget` 16), and its gradient is the fp32 sum of the four rows' gradients, each the
    row's call alone widened, not a sum rounded to bf16 at each micro-batch."""
    model_dir = tiny_qwen_dir if family == "qwen3" else tiny_llama_dir
    small = EngineOptions(row_tokens=16, token_budget=16)
    resource, session, params, sums = _bf16_session(model_dir, tmp_path, small)
    rows = random_batch(70, n=4, lengths=(16, 16), weights="ones")
    alone = _each_alone(session, params, sums, [[row] for row in rows])
    session.forward_backward(CE, rows)
    _assert_fp32_sum(sums, alone, params)
    resource.close()
