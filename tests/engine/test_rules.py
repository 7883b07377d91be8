"""The rulebook (`trainer.contract.rules`): each check of a request's content is written once and
run by the HTTP edge, the engine and the Tinker face, each naming the field in its own terms
(`samples[1]` on the RL face, `forward_backward_input.data[1]` on the Tinker face) with the same
words."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from tests.engine.helpers import model_input, sample
from trainer.api.tinker.convert import TinkerInputError, forward_backward_body, sample_body
from trainer.compute.batch import check_rules, prepare_samples
from trainer.contract.errors import InputError, OperationError
from trainer.contract.losses import LossConfig
from trainer.contract.rules import Limits, check_ids, check_prompts
from trainer.contract.specs import ModelEntry, Sample, SamplingParams, TensorData
from trainer.engine.generator import Generator
from trainer.serving.errors import ApiError
from trainer.serving.requests import (
    ForwardBackwardBody,
    SampleBody,
    check_forward_backward,
    check_sample,
)

VOCAB = 128
ENTRY = ModelEntry(
    name="tiny", location="unused", max_seq_length=16, max_batch_size=4, max_tokens_per_call=40
)
TINKER = "forward_backward_input.data"
IS = LossConfig(type="importance_sampling")


def _policy(tokens: list[int], **change: Any) -> tuple[Sample, dict[str, Any]]:
    """One importance-sampling sample on both faces: the RL face's `Sample` and the Tinker
    datum, with `change` (input name -> values, a (values, dtype) pair, or None to drop it)."""
    n = len(tokens)
    inputs: dict[str, Any] = {
        "target_tokens": ([t + 1 for t in tokens], "int64"),
        "logprobs": ([-1.0] * n, "float32"),
        "advantages": ([0.5] * n, "float32"),
    }
    for name, value in change.items():
        if value is None:
            inputs.pop(name)
        else:
            inputs[name] = value if isinstance(value, tuple) else (value, inputs[name][1])
    rl = Sample.model_construct(
        model_input=model_input(tokens),
        loss_fn_inputs={
            name: TensorData.model_construct(data=data, dtype=dtype)
            for name, (data, dtype) in inputs.items()
        },
    )
    datum = {
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
        "loss_fn_inputs": {k: {"data": d, "dtype": t} for k, (d, t) in inputs.items()},
    }
    return rl, datum


def _refusal(call: Callable[[], Any]) -> tuple[str, str]:
    """The (field, detail) a face refuses with."""
    with pytest.raises((ApiError, OperationError, TinkerInputError)) as info:
        call()
    exc = info.value
    field = exc.param if isinstance(exc, ApiError) else exc.field
    assert field is not None
    text = exc.message if isinstance(exc, ApiError | OperationError) else str(exc)
    assert text.startswith(f"{field}: "), text
    return field, text.removeprefix(f"{field}: ")


def _three_faces(bad: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    good, _ = _policy([3, 4, 5])
    rl, datum = _policy([5, 6, 7], **bad)
    edge = _refusal(lambda: check_forward_backward(_body([good, rl]), ENTRY))
    engine = _refusal(lambda: _engine([good, rl]))
    _, good_datum = _policy([3, 4, 5])
    fbi = {"data": [good_datum, datum], "loss_fn": "importance_sampling"}
    tinker = _refusal(lambda: forward_backward_body(fbi, False))
    return edge, engine, tinker


def _body(samples: list[Sample]) -> ForwardBackwardBody:
    return ForwardBackwardBody.model_construct(loss=IS, samples=samples)


def _engine(samples: list[Sample]) -> None:
    spec = IS.spec
    prepared = prepare_samples(
        samples,
        vocab_size=VOCAB,
        max_seq_length=ENTRY.max_seq_length,
        max_batch_size=ENTRY.max_batch_size,
        required=spec.required,
        weights_are_mask=spec.weights_are_mask,
    )
    check_rules(prepared, spec.rules_for(IS.params()))


@pytest.mark.parametrize(
    ("bad", "field", "detail"),
    [
        (
            {"logprobs": [-1.0, -1.0]},
            "loss_fn_inputs.logprobs",
            "has 2 values for 3 model_input tokens",
        ),
        (
            {"target_tokens": ([6, 7, 8], "float32")},
            "loss_fn_inputs.target_tokens.dtype",
            "must be one of ['int64']",
        ),
    ],
)
def test_one_rule_one_wording_on_every_face(bad: dict[str, Any], field: str, detail: str) -> None:
    edge, engine, tinker = _three_faces(bad)
    assert edge == engine == (f"samples[1].{field}", detail)
    assert tinker == (f"{TINKER}[1].{field}", detail)


def test_who_needs_an_input_is_said_in_each_face_s_terms() -> None:
    edge, engine, tinker = _three_faces({"advantages": None})
    field = "loss_fn_inputs.advantages"
    assert edge == (f"samples[1].{field}", "is required by loss LOSS_TYPE_IMPORTANCE_SAMPLING")
    assert engine == (f"samples[1].{field}", "is required by this loss")
    assert tinker == (f"{TINKER}[1].{field}", "is required by loss importance_sampling")


def test_token_ids_are_checked_against_the_vocabulary_where_it_is_known() -> None:
    edge, engine, tinker = _three_faces({"target_tokens": [6, -1, 8]})
    field = "loss_fn_inputs.target_tokens[1]"
    assert edge == (f"samples[1].{field}", "negative token id -1")
    assert tinker == (f"{TINKER}[1].{field}", "negative token id -1")
    assert engine == (f"samples[1].{field}", f"token id -1 out of range [0, {VOCAB})")
    good, _ = _policy([3, 4, 5])
    out_of_vocab, _ = _policy([5, 6, 7], target_tokens=[6, 999, 8])
    check_forward_backward(_body([good, out_of_vocab]), ENTRY)  # the edge has no vocabulary
    assert _refusal(lambda: _engine([good, out_of_vocab]))[0] == f"samples[1].{field}"
    with pytest.raises(InputError, match=rf"^chunks\[2\]: token id {2**70} out of range"):
        check_ids([1, 2, 2**70], "chunks", VOCAB)  # past int64, named by its position
    assert check_ids([1, 2, 2**70], "chunks").tolist()[:2] == [1, 2]  # the edge: not negative


def test_finiteness_is_one_rule_for_both_faces() -> None:
    with pytest.raises(ValidationError, match=r"data\[1\]: is not finite"):
        TensorData(data=[0.0, float("nan")], dtype="float32")
    _, datum = _policy([5, 6, 7], logprobs=[-1.0, float("inf"), -1.0])
    fbi = {"data": [datum], "loss_fn": "importance_sampling"}
    field = f"{TINKER}[0].loss_fn_inputs.logprobs.data[1]"
    assert _refusal(lambda: forward_backward_body(fbi, False)) == (field, "is not finite")


def test_weights_and_mask_are_one_rule() -> None:
    pair = [1.0, 1.0]
    both = sample([1, 2], [2, 3], logprobs=pair, advantages=pair, weights=pair, mask=pair)
    edge = _refusal(lambda: check_forward_backward(_body([both]), ENTRY))
    engine = _refusal(lambda: _engine([both]))
    assert (
        edge == engine == ("samples[0].loss_fn_inputs", "weights and mask are mutually exclusive")
    )


def _generator_check(body: SampleBody) -> list[list[int]]:
    """`Generator._check_prompts` on a resource that is only its entry and vocabulary."""
    session = SimpleNamespace(resource=SimpleNamespace(entry=ENTRY, vocab_size=VOCAB))
    return Generator._check_prompts(  # type: ignore[arg-type]
        session,
        body.model_inputs,
        body.num_samples,
        body.sampling_params,
        body.topk_prompt_logprobs,
    )


@pytest.mark.parametrize(
    ("prompts", "num_samples", "max_tokens", "field", "words"),
    [
        ([[1, 2]], 1, 16, "sampling_params.max_tokens", "below the context length 16 of tiny"),
        ([list(range(1, 12))], 1, 6, "model_inputs[0]", "11 prompt tokens + max_tokens 6"),
        ([[1, 2]] * 3, 2, 8, "num_samples", "max_batch_size 4 of tiny"),
        ([[1, 2]] * 5, 1, 8, "model_inputs", "max_batch_size 4 of tiny"),
        ([[1, 2, 3]] * 2, 2, 8, "sampling_params.max_tokens", "max_tokens_per_call 40 of tiny"),
        (
            [[1, 2], [3, -4]],
            1,
            4,
            "model_inputs[1].chunks[0].encoded_text.tokens[1]",
            "negative token id -4",
        ),
    ],
)
def test_sample_calls_are_checked_once_for_the_edge_and_the_engine(
    prompts: list[list[int]], num_samples: int, max_tokens: int, field: str, words: str
) -> None:
    body = SampleBody.model_construct(
        model_inputs=[model_input(p) for p in prompts],
        num_samples=num_samples,
        sampling_params=SamplingParams(max_tokens=max_tokens),
        topk_prompt_logprobs=0,
    )
    edge = _refusal(lambda: check_sample(body, ENTRY))
    engine = _refusal(lambda: _generator_check(body))
    assert edge[0] == field and words in edge[1]
    if "negative" in words:  # the engine knows the vocabulary
        assert engine == (field, f"token id -4 out of range [0, {VOCAB})")
    else:
        assert engine == edge


def test_prompts_come_back_as_their_token_ids() -> None:
    body = SampleBody(
        model_inputs=[model_input([5, 6]), model_input([7])],
        num_samples=2,
        sampling_params=SamplingParams(max_tokens=4),
    )
    assert _generator_check(body) == [[5, 6], [7]]
    limits = Limits.of(ENTRY, vocab_size=VOCAB)
    with pytest.raises(
        InputError,
        match=r"^model_inputs\[0\]\.chunks\[0\]\.encoded_text\.tokens\[0\]: token id 128",
    ):
        check_prompts([model_input([128])], 1, 1, 0, limits)


def test_the_tinker_face_validates_with_the_engine_specs_under_its_names() -> None:
    def field_of(**change: Any) -> str:
        req = {"prompt": {"chunks": [{"tokens": [1, 2]}]}, "sampling_params": {}, **change}
        with pytest.raises(TinkerInputError) as info:
            sample_body(req)
        return info.value.field

    assert field_of(sampling_params={"stop": [1, -2]}) == "sampling_params.stop[1]"
    assert field_of(sampling_params={"temperature": 5e-7}) == "sampling_params.temperature"
    assert field_of(sampling_params={"top_p": 0.0}) == "sampling_params.top_p"
    assert field_of(sampling_params={"max_tokens": 0}) == "sampling_params.max_tokens"
    assert field_of(sampling_params={"top_k": 0}) == "sampling_params.top_k"
    assert field_of(num_samples=0) == "num_samples"
    with pytest.raises(ValidationError) as info:  # the same bound on the RL face
        SamplingParams(stop_token_ids=[1, -2])
    assert info.value.errors()[0]["loc"] == ("stop_token_ids", 1)
