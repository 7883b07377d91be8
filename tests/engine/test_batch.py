"""Validation names the field; packing is exact; micro-batching does not change the gradient."""

from __future__ import annotations

import pytest
import torch

from tests.engine.helpers import grads_of, make_resource, random_batch, sample
from trainer.compute.batch import pack, prepare_samples
from trainer.contract.errors import OperationError
from trainer.contract.options import EngineOptions
from trainer.contract.specs import LossConfig, SessionSpec


def _prepare(samples, **kw):
    return prepare_samples(samples, vocab_size=128, max_seq_length=16, max_batch_size=4, **kw)


@pytest.mark.parametrize(
    ("samples", "kwargs", "field"),
    [
        ([], {}, "samples"),
        ([sample([1, 2], [2, 3])] * 5, {}, "samples"),
        ([sample(list(range(2, 20)), list(range(3, 21)))], {}, "samples[0].model_input"),
        ([sample([1, 2], [2, 300])], {}, "samples[0].loss_fn_inputs.target_tokens[1]"),
        ([sample([1, -2], [2, 3])], {}, "samples[0].model_input.chunks[0].encoded_text.tokens[1]"),
        ([sample([1, 2], [2])], {}, "samples[0].loss_fn_inputs.target_tokens"),
        ([sample([1, 2], [2, 3], advantages=[1.0])], {}, "samples[0].loss_fn_inputs.advantages"),
        (
            [sample([1, 2], [2, 3], weights=[1, 1], mask=[1, 1])],
            {},
            "samples[0].loss_fn_inputs",
        ),
        (
            [sample([1, 2], [2, 3])],
            {"required": ("advantages",)},
            "samples[0].loss_fn_inputs.advantages",
        ),
    ],
)
def test_validation_names_the_field(samples, kwargs, field) -> None:
    with pytest.raises(OperationError) as info:
        _prepare(samples, **kwargs)
    assert info.value.code == "INVALID_INPUT"
    assert info.value.message.startswith(field + ":"), info.value.message


def test_pack_keeps_samples_whole_and_masks_blocks() -> None:
    samples = _prepare(random_batch(0, n=4, lengths=(3, 9), weights="mask"))
    batches = pack(samples, row_tokens=10, token_budget=12)
    seen = sorted(s.index for b in batches for s in b.samples)
    assert seen == [0, 1, 2, 3]
    for batch in batches:
        mask = batch.attention_mask_R_1_L_L[:, 0]
        rows, _width = batch.tokens_R_L.shape
        assert batch.num_tokens <= max(12, max(s.length for s in batch.samples))
        for r in range(rows):
            # causal and block-diagonal: a position never sees a later one
            assert not torch.triu(mask[r], diagonal=1).any()
        assert batch.keep_index_P.shape == batch.targets_P.shape == batch.sample_index_P.shape


def test_packed_logprobs_equal_one_sample_at_a_time(tiny_model_dir, tmp_path) -> None:
    """Padding-free packing (several samples per row) is exact against unpacked forwards."""
    from transformers import AutoModelForCausalLM

    resource = make_resource(tiny_model_dir, tmp_path, lora=False, generator=False)
    session = resource.create_session("s", SessionSpec())
    samples = random_batch(1, n=6, lengths=(2, 20), weights="ones")
    packed = session.forward_backward(
        LossConfig(type="cross_entropy"), samples, forward_only=True, return_loss_fn_outputs=True
    )
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for i, s in enumerate(samples):
        ids = torch.tensor([s.model_input.tokens])
        with torch.no_grad():
            logp = torch.log_softmax(plain(input_ids=ids).logits[0].float(), -1)
        targets = torch.tensor([int(t) for t in s.loss_fn_inputs["target_tokens"].data])
        expected = logp.gather(-1, targets[:, None]).squeeze(-1)
        got = torch.tensor(packed["loss_fn_outputs"][i]["tensors"]["logprobs"]["data"])
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("loss_type", ["LOSS_TYPE_CROSS_ENTROPY", "LOSS_TYPE_GRPO"])
def test_micro_batches_give_the_same_gradient(tiny_qwen_dir, tmp_path, loss_type) -> None:
    """1×B and 4×(B/4): fixed call-level denominators make the gradients equal (rel ≤ 1e-5)."""
    extra = (
        {"weights": "ones"}
        if loss_type == "LOSS_TYPE_CROSS_ENTROPY"
        else {"logprobs": "logprobs", "advantages": "randn", "mask": "mask"}
    )
    samples = random_batch(2, n=8, lengths=(4, 16), **extra)
    loss = LossConfig(type=loss_type)
    results = []
    for budget in (10_000, 16):
        opts = EngineOptions(row_tokens=16, token_budget=budget, chunk_tokens=8)
        resource = make_resource(tiny_qwen_dir, tmp_path / str(budget), lora=False, options=opts)
        session = resource.create_session("s", SessionSpec())
        out = session.forward_backward(loss, samples)
        results.append((out["loss"], grads_of(session)))
        assert (
            budget > 100 or len(pack(session._prepare(samples), row_tokens=16, token_budget=16)) > 2
        )
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert loss_a == pytest.approx(loss_b, rel=1e-5)
    num = sum(float((grads_a[k] - grads_b[k]).norm() ** 2) for k in grads_a) ** 0.5
    den = sum(float(grads_a[k].norm() ** 2) for k in grads_a) ** 0.5
    assert num / den <= 1e-5


def test_activation_checkpointing_gives_the_same_gradients(tiny_qwen_dir, tmp_path) -> None:
    samples = random_batch(11, n=4, lengths=(4, 16), weights="ones")
    grads = []
    for checkpointing in (False, True):
        opts = EngineOptions(activation_checkpointing=checkpointing)
        resource = make_resource(
            tiny_qwen_dir, tmp_path / str(checkpointing), lora=False, options=opts
        )
        session = resource.create_session("s", SessionSpec())
        session.forward_backward(LossConfig(type="cross_entropy"), samples)
        grads.append(grads_of(session))
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-5, rtol=1e-5)
