"""Embedding calls (docs/semantics.md §27) against plain transformers: each sequence alone through
the model's own decoder, pooled, and the objectives written out here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.engine.helpers import grads_of, make_resource, model_input, random_batch
from trainer.compute import optim
from trainer.contract.embeddings import EmbeddingObjective
from trainer.contract.errors import OperationError
from trainer.contract.options import EngineOptions
from trainer.contract.specs import Gradient, LoraConfig, LossConfig, Sample, SessionSpec
from trainer.tiny_families import save_family

B, TAU = 3, 0.05


def _texts(seed: int, n: int, lengths: tuple[int, int] = (3, 12)) -> list[Sample]:
    """`n` token sequences with no loss inputs, as an embedding call takes them."""
    return [Sample(model_input=s.model_input) for s in random_batch(seed, n=n, lengths=lengths)]


def _tokens(sample: Sample) -> list[int]:
    return [int(t) for t in sample.model_input.chunks[0].encoded_text.tokens]


def _plain(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _reference_vectors(model, samples: list[Sample], pooling: str) -> torch.Tensor:
    """Each sequence alone through the model's decoder, pooled."""
    rows = []
    for s in samples:
        hidden = model.get_decoder()(input_ids=torch.tensor([_tokens(s)])).last_hidden_state[0]
        rows.append(hidden.float().mean(0) if pooling == "mean" else hidden[-1].float())
    return torch.stack(rows)


def _info_nce(vectors: torch.Tensor, b: int, tau: float, extra: int = 0) -> torch.Tensor:
    """The cookbook's bidirectional InfoNCE, written out (extras: documents without a query)."""
    z = vectors / vectors.norm(dim=-1, keepdim=True)
    q, d = z[:b], z[b:]
    t = torch.arange(b)
    q2d = F.cross_entropy(q @ d.T / tau, t)
    d2q = F.cross_entropy(d[:b] @ q.T / tau, t)
    return 0.5 * (q2d + d2q)


def _objective(output: str, **extra) -> EmbeddingObjective:
    return EmbeddingObjective(output=output, **extra)  # type: ignore[arg-type]


CONTRASTIVE = _objective("contrastive_loss", num_queries=B, temperature=TAU, pooling="last")


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, tiny_qwen_dir, tiny_llama_dir, tiny_moe_dir) -> dict[str, Path]:
    """qwen3 and llama (packed), qwen3_moe (fused experts), qwen3_5 (linear attention: one
    sample per row), gemma3 (sliding windows)."""
    out = {"qwen3": tiny_qwen_dir, "llama": tiny_llama_dir, "qwen3_moe": tiny_moe_dir}
    for name in ("qwen3_5", "gemma3"):
        out[name] = save_family(name, tmp_path_factory.mktemp(f"embed-{name}"))
    return out


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_moe", "qwen3_5", "gemma3"])
@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_forward_vectors_equal_each_sequence_alone(family, pooling, family_dirs, tmp_path):
    model_dir = family_dirs[family]
    resource = make_resource(model_dir, tmp_path, lora=False, generator=False)
    session = resource.create_session("a", SessionSpec())
    samples = _texts(1, 5)
    want = _reference_vectors(_plain(model_dir), samples, pooling)
    out = session.embedding_forward_backward(
        samples, _objective("embedding", pooling=pooling), True
    )
    torch.testing.assert_close(torch.tensor(out["outputs"]), want, atol=2e-5, rtol=1e-4)
    cos = session.embedding_forward_backward(
        samples, _objective("cos_similarity_matrix", pooling=pooling), True
    )
    unit = want / want.norm(dim=-1, keepdim=True)
    torch.testing.assert_close(torch.tensor(cos["outputs"]), unit @ unit.T, atol=2e-5, rtol=1e-4)
    assert all(p.grad is None for p in session.policy.trainable.values())
    resource.close()


def _reference_grads(model_dir: Path, samples: list[Sample], pooling: str, extra: int = 0):
    model = _plain(model_dir)
    model.requires_grad_(True)
    loss = _info_nce(_reference_vectors(model, samples, pooling), B, TAU, extra)
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("budget", [None, 16])
def test_contrastive_gradients_match_plain_transformers(budget, tiny_model_dir, tmp_path):
    """Full weights; the call is one micro-batch, or several (`token_budget` 16: the two-pass
    backward of the module docstring of `embed_pass`), with two extra negatives."""
    options = EngineOptions(row_tokens=16, token_budget=16) if budget else None
    resource = make_resource(tiny_model_dir, tmp_path, lora=False, options=options)
    session = resource.create_session("a", SessionSpec())
    samples = _texts(2, 2 * B + 2)
    objective = CONTRASTIVE.model_copy(update={"num_extra_negatives": 2})
    out = session.embedding_forward_backward(samples, objective)
    loss, want = _reference_grads(tiny_model_dir, samples, "last", extra=2)
    assert out["metrics"]["loss"] == pytest.approx(loss, rel=1e-5)
    assert set(out["metrics"]) == {"loss", "loss_q2d", "loss_d2q", "in_batch_recall_at_1"}
    for name, grad in grads_of(session).items():
        torch.testing.assert_close(grad, want[name], atol=2e-5, rtol=1e-4)
    forward = session.embedding_forward_backward(samples, objective, True)
    assert forward["metrics"]["loss"] == pytest.approx(loss, rel=1e-5)
    assert forward["outputs"] is None
    resource.close()


def test_client_side_modes_give_the_contrastive_gradient(tiny_qwen_dir, tmp_path):
    """The recipe's three modes: vectors out, the loss on the client, their gradients back
    (`embedding`); similarity rows out, the loss on the client, dL/dS back
    (`cos_similarity_matrix`); the loss here (`contrastive_loss`). Same gradient."""
    resource = make_resource(tiny_qwen_dir, tmp_path, lora=False)
    session = resource.create_session("a", SessionSpec())
    samples = _texts(3, 2 * B)
    session.embedding_forward_backward(samples, CONTRASTIVE)
    want = grads_of(session)
    session.optimizer.zero_grad(set_to_none=True)

    vectors = session.embedding_forward_backward(
        samples, _objective("embedding", pooling="last"), True
    )
    leaf = torch.tensor(vectors["outputs"], requires_grad=True)
    _info_nce(leaf, B, TAU).backward()
    grads = [Gradient(data=row) for row in leaf.grad.tolist()]
    session.embedding_forward_backward(
        samples, _objective("embedding", pooling="last"), False, grads
    )
    for name, grad in grads_of(session).items():
        torch.testing.assert_close(grad, want[name], atol=2e-5, rtol=1e-4)
    session.optimizer.zero_grad(set_to_none=True)

    cos = _objective("cos_similarity_matrix", pooling="last")
    rows = torch.tensor(session.embedding_forward_backward(samples, cos, True)["outputs"])
    leaf = rows.clone().requires_grad_(True)
    t = torch.arange(B)
    loss = 0.5 * (F.cross_entropy(leaf[:B, B:] / TAU, t) + F.cross_entropy(leaf[B:, :B] / TAU, t))
    loss.backward()
    grads = [Gradient(data=row) for row in leaf.grad.tolist()]
    session.embedding_forward_backward(samples, cos, False, grads)
    for name, grad in grads_of(session).items():
        torch.testing.assert_close(grad, want[name], atol=2e-5, rtol=1e-4)
    resource.close()


def test_both_forwards_of_a_split_call_draw_the_same_dropout(tiny_llama_dir, tmp_path):
    """LoRA dropout 0.5 and several micro-batches: the forward without gradients and the one
    that backpropagates see the same dropout masks, so the gradient is the objective's."""
    options = EngineOptions(row_tokens=16, token_budget=16)
    resource = make_resource(tiny_llama_dir, tmp_path, options=options)
    lora = LoraConfig(rank=4, dropout=0.5, seed=1)
    session = resource.create_session("a", SessionSpec(lora_config=lora))
    seen: list[torch.Tensor] = []
    hooks = [
        module.register_forward_hook(lambda m, i, o: seen.append(o.detach().clone()))
        for name, module in session.policy.model.named_modules()
        if isinstance(module, torch.nn.Dropout) and "lora_dropout" in name
    ]
    assert hooks
    session.embedding_forward_backward(_texts(4, 2 * B, lengths=(9, 12)), CONTRASTIVE)
    for hook in hooks:
        hook.remove()
    half = len(seen) // 2
    assert half > 0 and len(seen) == 2 * half
    assert any((o == 0).any() for o in seen)  # dropout did drop
    for first, second in zip(seen[:half], seen[half:], strict=True):
        assert torch.equal(first, second)
    resource.close()


def test_embedding_calls_add_to_the_gradients_and_failures_leave_none(tiny_qwen_dir, tmp_path):
    """LoRA: a cross-entropy call, then a contrastive one: the sum of each alone; a call
    refused as non-finite or as bad input in between leaves them as they were."""
    resource = make_resource(tiny_qwen_dir, tmp_path)
    session = resource.create_session("a", SessionSpec(lora_config=LoraConfig(rank=4, seed=2)))
    ce, texts = random_batch(5, n=3, weights="ones"), _texts(6, 2 * B)
    session.forward_backward(LossConfig(type="cross_entropy"), ce)
    first = grads_of(session)
    session.optimizer.zero_grad(set_to_none=True)
    session.embedding_forward_backward(texts, CONTRASTIVE)
    second = grads_of(session)
    session.optimizer.zero_grad(set_to_none=True)

    session.forward_backward(LossConfig(type="cross_entropy"), ce)
    huge = [Gradient(data=[3e38] * 64) for _ in texts]
    embedding = _objective("embedding")
    with pytest.raises(OperationError) as info:
        session.embedding_forward_backward(texts, embedding, False, huge)
    assert info.value.code == "NON_FINITE_LOSS"
    short = [Gradient(data=[1.0] * 63) for _ in texts]
    with pytest.raises(OperationError, match=r"gradients\[0\]\.data.*hidden size 64"):
        session.embedding_forward_backward(texts, embedding, False, short)
    counts = (session.accumulated_tokens, session.accumulated_sequences)
    session.embedding_forward_backward(texts, CONTRASTIVE)
    assert (session.accumulated_tokens, session.accumulated_sequences) == counts  # none added
    for name, grad in grads_of(session).items():
        parts = [g for g in (first[name], second[name]) if g is not None]
        if grad is None:  # neither call reaches it
            assert not parts
            continue
        torch.testing.assert_close(grad, sum(parts), atol=1e-6, rtol=1e-5)
    resource.close()


def test_bf16_full_weights_widen_embedding_gradients(tiny_llama_dir, tmp_path):
    """With masters (bf16 full weights), an embedding backward's gradients go into the fp32
    sums, as a forward-backward's do."""
    resource = make_resource(
        tiny_llama_dir, tmp_path, lora=False, generator=False, dtype="bfloat16"
    )
    session = resource.create_session("a", SessionSpec())
    session.embedding_forward_backward(_texts(7, 2 * B), CONTRASTIVE)
    sums = optim.wide_grads(session.optimizer)
    params = list(session.policy.trainable.values())
    assert sums and all(p.grad is None for p in params)
    assert all(s.dtype == torch.float32 for s in sums.values())
    head = session.policy.model.get_output_embeddings().weight
    assert set(sums) == {p for p in params if p is not head}  # the head has no part in it
    resource.close()


@pytest.mark.parametrize(
    ("objective", "forward_only", "grads", "field"),
    [
        (CONTRASTIVE.model_copy(update={"num_queries": 2}), False, None, r"samples: .*= 4 samples"),
        (_objective("contrastive_loss", temperature=TAU), False, None, "objective.num_queries"),
        (_objective("embedding", temperature=TAU), True, None, "objective.temperature"),
        (_objective("embedding"), True, [[1.0] * 64] * 6, "gradients: are not taken"),
        (_objective("embedding"), False, None, "gradients: are required"),
        (_objective("cos_similarity_matrix"), False, [[1.0] * 5] * 6, r"gradients\[0\].data"),
        (CONTRASTIVE, False, [[1.0] * 64] * 6, "contrastive_loss computes its own"),
    ],
)
def test_bad_calls_are_refused_naming_the_field(
    objective, forward_only, grads, field, tiny_qwen_dir, tmp_path
):
    resource = make_resource(tiny_qwen_dir, tmp_path, lora=False, generator=False)
    session = resource.create_session("a", SessionSpec())
    gradients = None if grads is None else [Gradient(data=g) for g in grads]
    with pytest.raises(OperationError, match=field) as info:
        session.embedding_forward_backward(_texts(8, 2 * B), objective, forward_only, gradients)
    assert info.value.code == "INVALID_INPUT"
    with pytest.raises(OperationError, match=r"samples\[0\].loss_fn_inputs.target_tokens"):
        session.embedding_forward_backward(random_batch(9, n=6, weights="ones"), CONTRASTIVE)
    with pytest.raises(OperationError, match="out of range"):
        session.embedding_forward_backward(
            [Sample(model_input=model_input([500]))] * 6, CONTRASTIVE
        )
    assert all(p.grad is None for p in session.policy.trainable.values())
    resource.close()
