"""Tinker requests through `trainer.api.tinker.convert` into the engine, against Tinker's loss
formulas written here in plain torch on a plain transformers model (fp32), and the engine's
`logprobs_unmasked` flag against a plain log_softmax gather at every position."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import numpy as np
import pytest
import torch

from tests.engine.helpers import grads_of, make_resource, model_input, random_batch
from tests.tinker.venv import tinker_python
from trainer.api.tinker.convert import (
    SAMPLE_EXTRA,
    TinkerInputError,
    forward_backward_body,
    forward_backward_output,
    optim_step_body,
    optim_step_output,
    sample_body,
    sample_output,
)
from trainer.contract.errors import InputError
from trainer.contract.specs import LoraConfig, LossConfig, SessionSpec
from trainer.serving.operations import OPERATIONS
from trainer.serving.requests import ForwardBackwardBody, OptimStepBody, SampleBody

FORWARD_BACKWARD = OPERATIONS["forward-backward"]


def _plain_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _naive_logprobs(model, tokens: list[int], targets: list[int]) -> torch.Tensor:
    """Reference: one unpadded sequence, full logits, log_softmax, gather."""
    logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(targets)[:, None]).squeeze(-1)


def _datums(seed: int, n: int = 4, prompt: int = 3, **kinds: str) -> list[dict[str, Any]]:
    """Tinker datums (JSON shape): `prompt` prompt positions, advantages 0 there (as the cookbook
    builds them), per-sample advantages on the rest; `kinds` adds more inputs."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for s in random_batch(seed, n=n, lengths=(prompt + 3, prompt + 9)):
        tokens = s.model_input.tokens
        length = len(tokens)
        inputs: dict[str, Any] = {
            "target_tokens": {
                "data": [int(t) for t in s.loss_fn_inputs["target_tokens"].data],
                "dtype": "int64",
                "shape": [length],
            }
        }
        for name, kind in kinds.items():
            if kind == "logprobs":
                values = (-torch.rand(length, generator=gen) * 4 - 0.5).tolist()
            elif kind == "advantages":
                adv = float(torch.randn((), generator=gen))
                values = [0.0] * prompt + [adv] * (length - prompt)
            elif kind == "ratio_mask":
                values = [0.0] * prompt + [1.0] * (length - prompt)
            else:  # weights: zeros, fractions and negatives
                values = torch.randn(length, generator=gen) * (torch.arange(length) % 3 != 0)
                values = values.tolist()
            inputs[name] = {"data": values, "dtype": "float32", "shape": [length]}
        out.append(
            {
                "model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
                "loss_fn_inputs": inputs,
            }
        )
    return out


def _t(datum: dict[str, Any], name: str) -> torch.Tensor:
    return torch.tensor(datum["loss_fn_inputs"][name]["data"], dtype=torch.float32)


# Tinker's loss formulas (its docs), per datum, summed: lp = target logprobs (with grad)


def _ratio(d, lp):
    return torch.exp(lp - _t(d, "logprobs"))


def _tinker_loss(loss_fn: str, config: dict[str, float], d: dict[str, Any], lp: torch.Tensor):
    lo = config.get("clip_low_threshold", 0.8)
    hi = config.get("clip_high_threshold", 1.2)
    if loss_fn == "cross_entropy":
        return -(lp * _t(d, "weights")).sum()
    adv = _t(d, "advantages")
    if loss_fn == "importance_sampling" and "ratio_log_cap" in config:
        cap = config["ratio_log_cap"]
        return -(torch.exp(torch.clamp(lp - _t(d, "logprobs"), -cap, cap)) * adv).sum()
    if loss_fn == "importance_sampling":
        return -(_ratio(d, lp) * adv).sum()
    if loss_fn == "ppo":
        ratio = _ratio(d, lp)
        return -torch.min(ratio * adv, torch.clamp(ratio, lo, hi) * adv).sum()
    if loss_fn == "cispo":
        clipped = torch.clamp(_ratio(d, lp), lo, hi)
        return -(clipped.detach() * lp * adv).sum()
    if loss_fn == "dro":
        quadratic = (lp - _t(d, "logprobs")) ** 2
        return -(lp * adv - 0.5 * config["beta"] * quadratic).sum()
    assert loss_fn == "gspo"
    in_ratio = _t(d, "sequence_ratio_mask") != 0
    log_ratio = (lp.detach() - _t(d, "logprobs"))[in_ratio].mean()
    ratio = torch.exp(log_ratio + lp - lp.detach())
    return -torch.min(ratio * adv, torch.clamp(ratio, lo, hi) * adv).sum()


CASES = [
    ("cross_entropy", {}, {"weights": "weights"}),
    ("importance_sampling", {}, {"logprobs": "logprobs", "advantages": "advantages"}),
    (
        "importance_sampling",
        {"ratio_log_cap": 4.0},  # clamps some tokens, not all
        {"logprobs": "logprobs", "advantages": "advantages"},
    ),
    ("ppo", {}, {"logprobs": "logprobs", "advantages": "advantages"}),
    (
        "ppo",
        {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
        {"logprobs": "logprobs", "advantages": "advantages"},
    ),
    ("cispo", {}, {"logprobs": "logprobs", "advantages": "advantages"}),
    (
        "cispo",
        {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5},
        {"logprobs": "logprobs", "advantages": "advantages"},
    ),
    ("dro", {"beta": 0.3}, {"logprobs": "logprobs", "advantages": "advantages"}),
    (
        "gspo",
        {},
        {"logprobs": "logprobs", "advantages": "advantages", "sequence_ratio_mask": "ratio_mask"},
    ),
    (
        "gspo",
        {"clip_low_threshold": 0.95, "clip_high_threshold": 1.05},
        {"logprobs": "logprobs", "advantages": "advantages", "sequence_ratio_mask": "ratio_mask"},
    ),
]


def _run(session, fbi: dict[str, Any], forward_only: bool = False) -> dict[str, Any]:
    """The Tinker request as the routes run it: converted, validated, through the op table."""
    body = ForwardBackwardBody.model_validate(forward_backward_body(fbi, forward_only))
    result: dict[str, Any] = FORWARD_BACKWARD.call(body)(session)
    return forward_backward_output(result, fbi["loss_fn"])


@pytest.mark.parametrize(("loss_fn", "config", "kinds"), CASES)
def test_loss_matches_tinker_formula(tiny_qwen_dir, tmp_path, loss_fn, config, kinds) -> None:
    datums = _datums(11, **kinds)
    fbi = {"data": datums, "loss_fn": loss_fn, "loss_fn_config": config or None}
    resource = make_resource(tiny_qwen_dir, tmp_path, lora=False)
    session = resource.create_session("a", SessionSpec())
    out = _run(session, fbi)

    model = _plain_model(tiny_qwen_dir)
    model.requires_grad_(True)
    lps = []
    total = torch.zeros(())
    for d in datums:
        tokens = d["model_input"]["chunks"][0]["tokens"]
        lp = _naive_logprobs(model, tokens, d["loss_fn_inputs"]["target_tokens"]["data"])
        lps.append(lp.detach())
        total = total + _tinker_loss(loss_fn, config, d, lp)
    total.backward()

    assert out["metrics"]["loss:sum"] == pytest.approx(float(total.detach()), rel=1e-5, abs=1e-5)
    ours = grads_of(session)
    reference = dict(model.named_parameters())
    checked = 0
    for name, grad in ours.items():
        ref = reference[name].grad
        assert grad is not None and ref is not None, name
        torch.testing.assert_close(grad, ref, atol=2e-5, rtol=1e-4)
        checked += int(ref.abs().max() > 0)
    assert checked > 0
    # per-datum logprobs at every position, prompt positions included
    assert out["loss_fn_output_type"] == "ArrayRecord"
    for got, ref in zip(out["loss_fn_outputs"], lps, strict=True):
        assert got["logprobs"].dtype == np.float32
        torch.testing.assert_close(torch.from_numpy(got["logprobs"]), ref, atol=1e-5, rtol=0)
    # every metric has exactly one reduction suffix the SDK knows
    for key in out["metrics"]:
        assert key.count(":") == 1 and key.split(":")[1] in ("sum", "mean"), key


def test_logprobs_unmasked_flag(tiny_qwen_dir, tmp_path) -> None:
    """With the flag: lp_t at every position (weight 0 included) equal to a plain gather, and
    the loss, gradients and metrics unchanged; without it: 0 where the weight is 0."""
    resource = make_resource(tiny_qwen_dir, tmp_path)
    spec = SessionSpec(lora_config=LoraConfig(rank=4, seed=1))
    plain, flagged = resource.create_session("a", spec), resource.create_session("b", spec)
    samples = random_batch(7, n=4, weights="mask")
    ce = LossConfig(type="cross_entropy")
    results = []
    for session, unmasked in ((plain, False), (flagged, True)):
        results.append(
            session.forward_backward(
                ce, samples, return_loss_fn_outputs=True, logprobs_unmasked=unmasked
            )
        )
    off, on = results
    assert on["loss"] == off["loss"]
    assert on["metrics"] == off["metrics"]
    forward = [  # forward only: the entropy metric too, over the weighted tokens
        plain.forward_backward(ce, samples, forward_only=True, logprobs_unmasked=unmasked)
        for unmasked in (False, True)
    ]
    assert "loss/entropy/mean" in forward[0]["metrics"]
    assert forward[0]["loss"] == forward[1]["loss"]
    for name, value in forward[0]["metrics"].items():
        assert forward[1]["metrics"][name] == pytest.approx(value, rel=1e-6, abs=1e-7), name
    g_off, g_on = grads_of(plain), grads_of(flagged)
    for name in g_off:
        assert (g_off[name] is None) == (g_on[name] is None)
        if g_off[name] is not None:
            assert torch.equal(g_off[name], g_on[name]), name
    model = _plain_model(tiny_qwen_dir)  # LoRA at init: the base model's logprobs
    with torch.no_grad():
        for s, a, b in zip(samples, off["loss_fn_outputs"], on["loss_fn_outputs"], strict=True):
            targets = [int(t) for t in s.loss_fn_inputs["target_tokens"].data]
            ref = _naive_logprobs(model, s.model_input.tokens, targets)
            weights = torch.tensor(s.loss_fn_inputs["weights"].data)
            assert bool((weights == 0).any())
            got_on = torch.tensor(b["tensors"]["logprobs"]["data"])
            got_off = torch.tensor(a["tensors"]["logprobs"]["data"])
            torch.testing.assert_close(got_on, ref, atol=1e-5, rtol=0)
            torch.testing.assert_close(
                got_off, torch.where(weights != 0, ref, 0.0), atol=1e-5, rtol=0
            )
            assert bool((got_off[weights == 0] == 0).all())


def test_forward_with_zero_weights_returns_every_logprob(tiny_qwen_dir, tmp_path) -> None:
    """The SDK's custom-loss forward (cross_entropy, weights all 0) gets real logprobs."""
    datums = _datums(3, n=3, weights="weights")
    for d in datums:
        n = len(d["loss_fn_inputs"]["target_tokens"]["data"])
        d["loss_fn_inputs"]["weights"] = {"data": [0.0] * n, "dtype": "float32", "shape": [n]}
    resource = make_resource(tiny_qwen_dir, tmp_path)
    session = resource.create_session("a", SessionSpec())
    out = _run(session, {"data": datums, "loss_fn": "cross_entropy"}, forward_only=True)
    assert out["metrics"]["loss:sum"] == 0.0
    model = _plain_model(tiny_qwen_dir)
    with torch.no_grad():
        for d, got in zip(datums, out["loss_fn_outputs"], strict=True):
            tokens = d["model_input"]["chunks"][0]["tokens"]
            ref = _naive_logprobs(model, tokens, d["loss_fn_inputs"]["target_tokens"]["data"])
            torch.testing.assert_close(torch.from_numpy(got["logprobs"]), ref, atol=1e-5, rtol=0)


_COMBINE = """
import json, sys
import numpy as np
from tinker.lib.chunked_fwdbwd_helpers import combine_fwd_bwd_output_results
from tinker.types import ForwardBackwardOutput, TensorData
outs = []
for part in json.loads(sys.stdin.read()):
    outputs = [{"logprobs": TensorData.from_numpy(np.array(o, dtype=np.float32))}
               for o in part["loss_fn_outputs"]]
    outs.append(ForwardBackwardOutput(part["loss_fn_output_type"], outputs, part["metrics"]))
combined = combine_fwd_bwd_output_results(outs)
print(json.dumps({"metrics": combined.metrics, "n": len(combined.loss_fn_outputs)}))
"""


def test_chunked_calls_combine_in_the_sdk(tiny_qwen_dir, tmp_path) -> None:
    """Two half-batch calls, combined by the SDK's own chunk reduction, give the full call's
    `loss:sum` and `loss/tokens:sum`."""
    kinds = {"logprobs": "logprobs", "advantages": "advantages"}
    datums = _datums(5, n=4, **kinds)
    resource = make_resource(tiny_qwen_dir, tmp_path)
    session = resource.create_session("a", SessionSpec())

    def call(part):
        return _run(session, {"data": part, "loss_fn": "ppo"}, forward_only=True)

    full, halves = call(datums), [call(datums[:2]), call(datums[2:])]
    payload = [
        {
            "loss_fn_output_type": h["loss_fn_output_type"],
            "loss_fn_outputs": [o["logprobs"].tolist() for o in h["loss_fn_outputs"]],
            "metrics": h["metrics"],
        }
        for h in halves
    ]
    proc = subprocess.run(
        [str(tinker_python()), "-c", _COMBINE],
        input=json.dumps(payload),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    combined = json.loads(proc.stdout.strip().splitlines()[-1])
    assert combined["n"] == 4
    assert set(combined["metrics"]) == set(full["metrics"])
    for key in ("loss:sum", "loss/tokens:sum"):
        assert combined["metrics"][key] == pytest.approx(full["metrics"][key], rel=1e-5), key


# -- errors name the field --------------------------------------------------------------------


def _fbi(loss_fn="importance_sampling", config=None, **kinds) -> dict[str, Any]:
    kinds = kinds or {"logprobs": "logprobs", "advantages": "advantages"}
    return {"data": _datums(2, n=2, **kinds), "loss_fn": loss_fn, "loss_fn_config": config}


def _field_of(fbi: dict[str, Any]) -> str:
    with pytest.raises(TinkerInputError) as info:
        forward_backward_body(fbi, False)
    assert info.value.field in str(info.value)
    return info.value.field


def test_forward_backward_errors_name_the_field() -> None:
    # stable_reinforce without provenance names the datum's spans
    assert _field_of(_fbi("stable_reinforce")) == "forward_backward_input.data[0].model_input_spans"
    assert _field_of(_fbi("custom")) == "forward_backward_input.loss_fn"
    assert _field_of(_fbi("dpo")) == "forward_backward_input.loss_fn"
    assert _field_of(_fbi("dro")) == "forward_backward_input.loss_fn_config.beta"
    bad_key = _fbi("ppo", {"clip_ratio": 0.2})
    assert _field_of(bad_key) == "forward_backward_input.loss_fn_config.clip_ratio"
    assert _field_of(_fbi(config={"beta": 1.0})) == "forward_backward_input.loss_fn_config.beta"
    low = _fbi("cispo", {"clip_low_threshold": 1.5})
    assert _field_of(low) == "forward_backward_input.loss_fn_config.clip_low_threshold"
    negative = _fbi(config={"ratio_log_cap": -0.1})
    assert _field_of(negative) == "forward_backward_input.loss_fn_config.ratio_log_cap"
    where = "forward_backward_input.data[1]"
    fbi = _fbi()
    fbi["data"][1]["loss_fn_inputs"]["mask"] = fbi["data"][1]["loss_fn_inputs"]["logprobs"]
    assert _field_of(fbi) == f"{where}.loss_fn_inputs.mask"
    fbi = _fbi()
    del fbi["data"][1]["loss_fn_inputs"]["advantages"]
    assert _field_of(fbi) == f"{where}.loss_fn_inputs.advantages"
    fbi = _fbi()
    fbi["data"][1]["loss_fn_inputs"]["advantages"]["data"].append(1.0)
    assert _field_of(fbi) == f"{where}.loss_fn_inputs.advantages.shape"
    fbi = _fbi()
    fbi["data"][1]["loss_fn_inputs"]["logprobs"]["data"][0] = float("nan")
    assert _field_of(fbi) == f"{where}.loss_fn_inputs.logprobs.data[0]"
    fbi = _fbi()
    fbi["data"][1]["model_input"]["chunks"].append({"type": "image", "format": "png"})
    assert _field_of(fbi) == f"{where}.model_input.chunks[1]"
    fbi = _fbi()
    fbi["data"][1]["model_input"]["chunks"][0]["tokens"][2] = -4
    assert _field_of(fbi) == f"{where}.model_input.chunks[0].tokens[2]"
    fbi = _fbi()
    fbi["data"][1]["loss_fn_inputs"]["target_tokens"]["dtype"] = "float32"
    assert _field_of(fbi) == f"{where}.loss_fn_inputs.target_tokens.dtype"
    # gspo: an advantage outside sequence_ratio_mask cannot be summed as Tinker does
    fbi = _fbi(
        "gspo", logprobs="logprobs", advantages="advantages", sequence_ratio_mask="ratio_mask"
    )
    fbi["data"][1]["loss_fn_inputs"]["advantages"]["data"][0] = 0.5
    assert _field_of(fbi) == f"{where}.loss_fn_inputs.advantages"
    assert _field_of({"data": [], "loss_fn": "ppo"}) == "forward_backward_input.data"


def test_bodies_validate_and_map_knobs() -> None:
    body = forward_backward_body(_fbi("ppo", {"clip_low_threshold": 0.7}), True)
    parsed = ForwardBackwardBody.model_validate(body)
    assert parsed.forward_only and parsed.return_loss_fn_outputs and parsed.logprobs_unmasked
    params = parsed.loss.params()
    assert (params.clip_low_threshold, params.clip_high_threshold) == (0.7, 1.2)
    cispo = ForwardBackwardBody.model_validate(forward_backward_body(_fbi("cispo"), False))
    params = cispo.loss.params()
    assert (params.clip_low_threshold, params.clip_high_threshold) == (0.8, 1.2)
    for sample in cispo.samples:  # no mask: every position counts
        assert set(sample.loss_fn_inputs) == {"target_tokens", "logprobs", "advantages"}


def test_optim_step_mapping() -> None:
    sdk = {"learning_rate": 3e-4, "beta1": 0.8, "beta2": 0.9, "eps": 1e-12}
    sdk |= {"weight_decay": 0.01, "grad_clip_norm": 0.0}
    body = optim_step_body({"adam_params": sdk, "model_id": "m", "seq_id": 3})
    assert OptimStepBody.model_validate(body).adam_params.model_dump() == sdk
    # a hand-written body gets Tinker's defaults (eps 1e-12, no clipping), not ours
    adam = OptimStepBody.model_validate(optim_step_body({"adam_params": {}})).adam_params
    assert (adam.eps, adam.grad_clip_norm) == (1e-12, 0.0)
    for req, field in (
        ({"optimizer_params": {"type": "dimuon", "learning_rate": 1e-3}}, "optim_params.type"),
        ({"adam_params": {"learning_rate": -1.0}}, "adam_params.learning_rate"),
        ({"adam_params": {"momentum": 0.9}}, "adam_params.momentum"),
        ({"adam_params": {"beta1": True}}, "adam_params.beta1"),
    ):
        with pytest.raises(TinkerInputError) as info:
            optim_step_body(req)
        assert info.value.field == field
    metrics = {"grad_norm": 2.0, "grad_norm_clipped": 1.0, "learning_rate": 1e-4}
    out = optim_step_output({"step": 3, "metrics": metrics})
    # the Fireworks cookbook's names beside ours
    assert out == {"metrics": {**metrics, "lr": 1e-4, "grad_norm_post_clip": 1.0}}


def test_sample_mapping() -> None:
    req = {
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}, {"tokens": [7]}]},
        "num_samples": 3,
        "sampling_params": {
            "max_tokens": 8,
            "temperature": 0.5,
            "top_k": 4,
            "top_p": 0.9,
            "seed": 11,
            "stop": [1, 9],
        },
        "prompt_logprobs": True,
        "topk_prompt_logprobs": 2,
        "base_model": "x",
    }
    body = SampleBody.model_validate(sample_body(req))
    assert body.model_inputs[0].tokens == [5, 6, 7] and body.num_samples == 3
    params = body.sampling_params
    assert (params.max_tokens, params.temperature, params.top_k, params.top_p) == (8, 0.5, 4, 0.9)
    assert (params.seed, params.stop, params.stop_token_ids) == (11, [], [1, 9])
    assert body.prompt_logprobs and body.topk_prompt_logprobs == 2
    text = sample_body({**req, "sampling_params": {"stop": "</s>"}})
    assert text["sampling_params"] == {"stop": ["</s>"]}
    for change, field in (
        ({"sampling_params": {"stop": []}}, "sampling_params.stop"),
        ({"sampling_params": {"min_p": 0.1}}, "sampling_params.min_p"),
        ({"topk_sample_logprobs": 21}, "topk_sample_logprobs"),  # served up to 20
        ({"prompt": {"chunks": [{"type": "image", "format": "png"}]}}, "prompt.chunks[0]"),
        ({"topk_prompt_logprobs": 21}, "topk_prompt_logprobs"),
    ):
        with pytest.raises(TinkerInputError) as info:
            sample_body({**req, **change})
        assert info.value.field == field
    ours = {
        "results": [
            {
                "sequences": [
                    {
                        "tokens": [3, 1],
                        "logprobs": [-0.5, -0.25],
                        "stop_reason": "STOP_REASON_STOP",
                    },
                    {"tokens": [4], "logprobs": [-1.0], "stop_reason": "STOP_REASON_LENGTH"},
                ],
                "policy_segments": [{"start_token": 0, "version": 0}],
                "prompt_logprobs": [0.0, -1.5, -2.5],
                "topk_prompt_logprobs": [
                    {"token_ids": [], "logprobs": []},
                    {"token_ids": [6, 2], "logprobs": [-1.5, -1.75]},
                    {"token_ids": [7, 5], "logprobs": [-2.5, -2.75]},
                ],
            }
        ]
    }
    assert sample_output(ours) == {
        "sequences": [
            {"tokens": [3, 1], "logprobs": [-0.5, -0.25], "stop_reason": "stop"},
            {"tokens": [4], "logprobs": [-1.0], "stop_reason": "length"},
        ],
        "prompt_logprobs": [None, -1.5, -2.5],
        "topk_prompt_logprobs": [None, [(6, -1.5), (2, -1.75)], [(7, -2.5), (5, -2.75)]],
        "prompt_cache_hit_tokens": 0,
    }


_SDK_REQUESTS = """
import base64, json
import torch
from tinker import types
from tinker._compat import model_dump
from tinker.proto.request_conv import forward_backward_request_to_proto

def dump(request):
    return model_dump(request, exclude_unset=False, exclude_none=True, mode="json")

datum = types.Datum(
    model_input=types.ModelInput.from_ints([5, 6]).append_int(7),
    loss_fn_inputs={
        "target_tokens": torch.tensor([6, 7, 8]),
        "logprobs": torch.tensor([-1.0, -2.0, -0.5]),
        "advantages": torch.tensor([0.0, 0.5, 0.5]),
        "sequence_ratio_mask": [0.0, 1.0, 1.0],
    },
)
fbi = types.ForwardBackwardInput(
    data=[datum], loss_fn="gspo", loss_fn_config={"clip_low_threshold": 0.9}
)
proto = forward_backward_request_to_proto(
    types.ForwardBackwardRequest(forward_backward_input=fbi, model_id="m", seq_id=1)
).SerializeToString()
adam = types.OptimStepRequest(
    adam_params=types.AdamParams(learning_rate=1e-3), model_id="m", seq_id=2
)
sample = types.SampleRequest(
    prompt=types.ModelInput.from_ints([1, 2]),
    sampling_params=types.SamplingParams(max_tokens=4, stop=[1], seed=5),
    num_samples=2, prompt_logprobs=True, topk_prompt_logprobs=2,
    sampling_session_id="s", seq_id=0,
)
print(json.dumps({"fwdbwd": base64.b64encode(proto).decode(), "optim": dump(adam),
                  "sample": dump(sample)}))
"""


def test_requests_the_sdk_serializes() -> None:
    """What tinker 0.38 puts on the wire (its own serializers, run in the venv) converts."""
    import base64

    from trainer.api.tinker.proto import decode_forward_backward_request

    proc = subprocess.run(
        [str(tinker_python()), "-c", _SDK_REQUESTS],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    sent = json.loads(proc.stdout.strip().splitlines()[-1])
    decoded = decode_forward_backward_request(base64.b64decode(sent["fwdbwd"]))
    body = ForwardBackwardBody.model_validate(
        forward_backward_body(decoded["forward_backward_input"], decoded["forward_only"])
    )
    (s,) = body.samples
    assert s.model_input.tokens == [5, 6, 7]
    assert [int(t) for t in s.loss_fn_inputs["target_tokens"].data] == [6, 7, 8]
    assert list(s.loss_fn_inputs["mask"].data) == [0.0, 1.0, 1.0]
    scale = 1 * 3  # num_samples · H
    assert list(s.loss_fn_inputs["advantages"].data) == [0.0, 0.5 * scale, 0.5 * scale]
    params = body.loss.params()
    assert body.loss.type == "LOSS_TYPE_GRPO" and params.ratio_type.endswith("SEQUENCE")
    assert (params.clip_low_threshold, params.clip_high_threshold) == (0.9, 1.2)
    adam = OptimStepBody.model_validate(optim_step_body(sent["optim"])).adam_params
    assert (adam.learning_rate, adam.eps, adam.grad_clip_norm) == (1e-3, 1e-12, 0.0)
    sample = SampleBody.model_validate(sample_body(sent["sample"]))
    assert sample.model_inputs[0].tokens == [1, 2] and sample.num_samples == 2
    assert sample.sampling_params.stop_token_ids == [1] and sample.sampling_params.seed == 5
    assert sample.prompt_logprobs and sample.topk_prompt_logprobs == 2


def test_sample_with_token_id_stop(tiny_qwen_dir, tmp_path) -> None:
    """An integer `stop` ends each sequence at the first such token (kept, stop_reason
    "stop"), as EOS does; prompt logprobs come back aligned, entry 0 None."""
    resource = make_resource(tiny_qwen_dir, tmp_path)
    session = resource.create_session("a", SessionSpec())
    sample_op = OPERATIONS["sample"]

    def run(**sampling: Any) -> dict[str, Any]:
        req = {
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
            "num_samples": 1,
            "sampling_params": {"max_tokens": 8, "temperature": 0.0, **sampling},
            "prompt_logprobs": True,
        }
        body = SampleBody.model_validate(sample_body(req))
        return sample_output(sample_op.call(body)(session))

    free = run()
    (seq,) = free["sequences"]
    assert len(seq["tokens"]) == 8 and seq["stop_reason"] == "length"
    stop = seq["tokens"][2]
    cut = seq["tokens"].index(stop) + 1
    other = next(t for t in range(128) if t not in seq["tokens"])
    (stopped,) = run(stop=[stop, other])["sequences"]
    assert stopped["tokens"] == seq["tokens"][:cut] and stopped["stop_reason"] == "stop"
    assert stopped["logprobs"] == seq["logprobs"][:cut]
    assert free["prompt_logprobs"][0] is None and len(free["prompt_logprobs"]) == 3
    model = _plain_model(tiny_qwen_dir)
    with torch.no_grad():
        expected = _naive_logprobs(model, [5, 6], [6, 7])
    torch.testing.assert_close(
        torch.tensor(free["prompt_logprobs"][1:]), expected, atol=1e-5, rtol=0
    )


def test_prompt_logprobs_last_n_is_checked_at_the_door() -> None:
    """N in [1, len(prompt) - 1], an integer, with prompt logprobs: each refusal names the
    field; a good N stays in the body for the engine (`SAMPLE_EXTRA`)."""
    req = {
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7, 8]}]},
        "sampling_params": {"max_tokens": 1},
        "prompt_logprobs": True,
        "topk_prompt_logprobs": 2,
    }
    assert SAMPLE_EXTRA not in sample_body(req)
    assert sample_body({**req, "prompt_logprobs_last_n": None}) == sample_body(req)
    for n in (1, 3):
        assert sample_body({**req, "prompt_logprobs_last_n": n})[SAMPLE_EXTRA] == n
    for change in (
        {"prompt_logprobs_last_n": 0},
        {"prompt_logprobs_last_n": -2},
        {"prompt_logprobs_last_n": 4},  # len(prompt): the first token has no context
        {"prompt_logprobs_last_n": 2.5},
        {"prompt_logprobs_last_n": "2"},
        {"prompt_logprobs_last_n": True},
        {"prompt_logprobs_last_n": 2, "prompt_logprobs": False},
        {"prompt_logprobs_last_n": 2, "prompt_logprobs": None},
    ):
        with pytest.raises(TinkerInputError) as info:
            sample_body({**req, **change})
        assert info.value.field == SAMPLE_EXTRA, (change, info.value)
    one = {**req, "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5]}]}}
    with pytest.raises(TinkerInputError, match="no token to score") as info:
        sample_body({**one, "prompt_logprobs_last_n": 1})
    assert info.value.field == SAMPLE_EXTRA


def test_prompt_logprobs_last_n_scores_the_suffix(tiny_qwen_dir, tmp_path) -> None:
    """`prompt_logprobs_last_n=N`: the last N entries of `prompt_logprobs` and of
    `topk_prompt_logprobs` are the full prompt's (and a plain model's), the earlier ones
    None; the engine refuses an N out of range itself, naming the field."""
    resource = make_resource(tiny_qwen_dir, tmp_path)
    session = resource.create_session("a", SessionSpec())
    sample_op = OPERATIONS["sample"]
    prompt = [5, 9, 6, 7, 11, 3, 8, 2]
    req = {
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
        "sampling_params": {"max_tokens": 1, "seed": 0},
        "prompt_logprobs": True,
        "topk_prompt_logprobs": 3,
    }

    def run(**change: Any) -> dict[str, Any]:
        body = sample_body({**req, **change})
        extra = {SAMPLE_EXTRA: body[SAMPLE_EXTRA]} if SAMPLE_EXTRA in body else None
        return sample_output(sample_op.call(SampleBody.model_validate(body), extra)(session))

    full = run()
    model = _plain_model(tiny_qwen_dir)
    with torch.no_grad():
        expected = _naive_logprobs(model, prompt[:-1], prompt[1:])
    torch.testing.assert_close(
        torch.tensor(full["prompt_logprobs"][1:]), expected, atol=1e-5, rtol=0
    )
    for n in (1, 3, len(prompt) - 1):
        got = run(prompt_logprobs_last_n=n)
        lps, top = got["prompt_logprobs"], got["topk_prompt_logprobs"]
        assert len(lps) == len(top) == len(prompt)
        cut = len(prompt) - n
        assert lps[:cut] == [None] * cut and top[:cut] == [None] * cut, (n, lps, top)
        # the head runs on the suffix alone: the same rows of the same matmul, up to rounding
        np.testing.assert_allclose(lps[cut:], full["prompt_logprobs"][cut:], atol=1e-6, rtol=0)
        for row, ref in zip(top[cut:], full["topk_prompt_logprobs"][cut:], strict=True):
            assert [t for t, _ in row] == [t for t, _ in ref]
            np.testing.assert_allclose([v for _, v in row], [v for _, v in ref], atol=1e-6)
    inputs = [model_input(prompt)]
    for n, kwargs in ((len(prompt), {}), (0, {}), (2, {"prompt_logprobs": False})):
        with pytest.raises(InputError) as info:
            session.sample(inputs, prompt_logprobs_last_n=n, **{"prompt_logprobs": True, **kwargs})
        assert info.value.field == SAMPLE_EXTRA
