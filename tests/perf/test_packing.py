"""Padding-free packing against the padded layout, through a real tiny decoder."""

from __future__ import annotations

import torch

from benchmarks.arms_engine import padded_layout
from tests.engine.helpers import random_batch
from trainer.compute.batch import pack, prepare_samples
from trainer.compute.logprobs import token_logprobs


def _logprobs(model, inputs: dict[str, torch.Tensor], keep: torch.Tensor, targets: torch.Tensor):
    hidden = model.get_decoder()(**inputs, use_cache=False).last_hidden_state
    hidden_P_H = hidden.reshape(-1, hidden.shape[-1])[keep]
    return token_logprobs(hidden_P_H, model.get_output_embeddings(), targets, chunk_tokens=7)[0]


def test_packed_and_padded_logprobs_are_equal(tiny_model_dir) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    samples = random_batch(5, n=7, lengths=(2, 30), mask="mask")
    prepared = prepare_samples(samples, vocab_size=128, max_seq_length=64, max_batch_size=16)
    # padded: one sample per row, right-padded, 2D padding mask
    with torch.no_grad():
        padded = _logprobs(model, *padded_layout(prepared))
        packed = []
        for micro in pack(prepared, row_tokens=40, token_budget=60):
            inputs = {
                "input_ids": micro.tokens_R_L,
                "position_ids": micro.position_ids_R_L,
                "attention_mask": micro.attention_mask_R_1_L_L,
            }
            packed.append(_logprobs(model, inputs, micro.keep_index_P, micro.targets_P))
    # micro-batches list samples in index order, as the padded layout does
    torch.testing.assert_close(torch.cat(packed), padded, atol=1e-5, rtol=0)


def test_packed_sdpa_equals_block_mask_with_gradients(tiny_model_dir, monkeypatch) -> None:
    """The varlen fallback (`packed_sdpa`, one unpadded row) equals the dense block-diagonal
    mask, values and gradients, within 1e-5; it reads the position ids to the host once per
    forward, not once per layer (on a GPU each read is a sync)."""
    from transformers import AutoModelForCausalLM

    from trainer.compute import attention
    from trainer.compute.attention import PACKED_SDPA, is_varlen, use_packed_sdpa

    reads = []
    split = attention._all_segments
    monkeypatch.setattr(attention, "_all_segments", lambda ids: reads.append(1) or split(ids))

    samples = random_batch(6, n=6, lengths=(1, 25), mask="mask")
    prepared = prepare_samples(samples, vocab_size=128, max_seq_length=64, max_batch_size=16)
    (micro,) = pack(prepared, row_tokens=32, token_budget=1000)
    assert len(micro.row_lengths) > 1 and is_varlen(PACKED_SDPA) and not is_varlen("sdpa")
    results = []
    for impl in ("sdpa", PACKED_SDPA):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        if impl == PACKED_SDPA:
            use_packed_sdpa(model)
        inputs, keep = micro.decoder_inputs(impl)
        assert ("attention_mask" in inputs) == (impl == "sdpa")
        lp = _logprobs(model, inputs, keep, micro.targets_P)
        lp.sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((lp.detach(), grads))
    (lp_a, grads_a), (lp_b, grads_b) = results
    assert model.config.num_hidden_layers >= 2 and len(reads) == 1
    torch.testing.assert_close(lp_b, lp_a, atol=1e-5, rtol=0)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], atol=1e-5, rtol=1e-5)


def test_packed_sdpa_leaves_padded_batches_and_generation_unchanged(tiny_model_dir) -> None:
    from transformers import AutoModelForCausalLM

    from trainer.compute.attention import use_packed_sdpa

    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    packed = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    use_packed_sdpa(packed)
    ids = torch.tensor([[0, 0, 5, 9, 17, 3], [4, 8, 15, 16, 23, 42]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        a = plain(input_ids=ids, attention_mask=mask).logits
        b = packed(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(b[mask.bool()], a[mask.bool()], atol=1e-5, rtol=0)
    prompt = torch.tensor([[3, 17, 42, 9]])
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(packed.generate(prompt, **kwargs), plain.generate(prompt, **kwargs))
