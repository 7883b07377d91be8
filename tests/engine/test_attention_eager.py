"""Packed batches under `eager` attention: eager adds the mask to the attention scores, so the
block-diagonal causal mask must reach it additive (0 / the dtype's lowest value), not boolean.
The reference is a plain transformers forward of each sample alone, without any mask."""

from __future__ import annotations

import pytest
import torch

from tests.engine.helpers import make_resource, random_batch
from trainer.compute.batch import pack, prepare_samples
from trainer.compute.logprobs import batch_logprobs
from trainer.contract.specs import LossConfig, SessionSpec


def _eager_model(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    assert model.config._attn_implementation == "eager"
    return model.eval()


def _reference(model, prepared) -> list[torch.Tensor]:
    """Each sample alone through the full model (logits → log_softmax → gather)."""
    out = []
    with torch.no_grad():
        for s in prepared:
            logits = model(input_ids=s.tokens_T[None]).logits[0].float()
            lp = torch.log_softmax(logits, -1).gather(-1, s.targets_T[:, None]).squeeze(-1)
            out.append(lp[s.mask_T != 0])
    return out


def _packed_batches(seed: int):
    samples = random_batch(seed, n=7, lengths=(2, 30), mask="mask")
    prepared = prepare_samples(samples, vocab_size=128, max_seq_length=64, max_batch_size=16)
    batches = pack(prepared, row_tokens=48, token_budget=80)
    # several samples share a row, and some rows are padded: both masks matter
    assert any(len(b.samples) > len(b.row_lengths) for b in batches)
    assert any(min(b.row_lengths) < b.tokens_R_L.shape[1] for b in batches)
    return prepared, batches


def test_packed_logprobs_under_eager_equal_unpacked(tiny_model_dir) -> None:
    model = _eager_model(tiny_model_dir)
    prepared, batches = _packed_batches(3)
    reference = _reference(model, prepared)
    got = []
    with torch.no_grad():
        for batch in batches:
            lp, _, _ = batch_logprobs(model, batch, torch.device("cpu"), 16, False)
            per_sample = lp.split([int((s.mask_T != 0).sum()) for s in batch.samples])
            got.extend(zip((s.index for s in batch.samples), per_sample, strict=True))
    assert sorted(i for i, _ in got) == list(range(len(prepared)))
    for index, lp in got:
        torch.testing.assert_close(lp, reference[index], atol=1e-5, rtol=0)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_attention_mask_form(impl) -> None:
    """SDPA keeps the boolean mask (True = attend); eager gets 0 where a token may attend and
    the dtype's lowest value elsewhere, in the model's dtype."""
    prepared = prepare_samples(
        random_batch(1, n=3, lengths=(2, 6)), vocab_size=128, max_seq_length=64, max_batch_size=8
    )
    (batch,) = pack(prepared, row_tokens=8, token_budget=100)
    allowed = batch.attention_mask_R_1_L_L
    for dtype in (torch.float32, torch.bfloat16):
        inputs, _ = batch.decoder_inputs(impl, "cpu", dtype)
        mask = inputs["attention_mask"]
        if impl == "sdpa":
            assert mask.dtype == torch.bool and torch.equal(mask, allowed)
        else:
            assert mask.dtype == dtype
            assert torch.equal(mask == 0, allowed)
            assert bool((mask[~allowed] == torch.finfo(dtype).min).all())


def test_session_on_eager_model_matches_reference(tiny_qwen_dir, tmp_path) -> None:
    """Through the engine: a LoRA session (step 0: the base model) on a resource whose model
    runs eager attention returns the unpacked reference logprobs for a packed call."""
    resource = make_resource(tiny_qwen_dir, tmp_path)
    resource.model.set_attn_implementation("eager")
    session = resource.create_session("a", SessionSpec())
    session.options.row_tokens = 48
    samples = random_batch(5, n=6, lengths=(2, 30), weights="ones")
    out = session.forward_backward(
        LossConfig(type="cross_entropy"), samples, forward_only=True, return_loss_fn_outputs=True
    )
    prepared = prepare_samples(samples, vocab_size=128, max_seq_length=256, max_batch_size=16)
    reference = _reference(_eager_model(tiny_qwen_dir), prepared)
    for result, ref in zip(out["loss_fn_outputs"], reference, strict=True):
        got = torch.tensor(result["tensors"]["logprobs"]["data"])
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
