"""Tinker's `SampleRequest` to and from the body and result of the engine's `sample` operation.

Split from `trainer.api.tinker.convert` (training conversions), which re-exports these names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainer.api.tinker.convert_inputs import (
    TinkerInputError,
    as_tinker,
    flag,
    integer,
    number,
    token_ids,
    validated,
)
from trainer.contract.rules import check_last_n, check_num_samples, check_topk
from trainer.contract.specs import SamplingParams

__all__ = ["SAMPLE_EXTRA", "sample_body", "sample_output"]

# SampleRequest fields that select the model or sequence (the routes' business) or are off
_SAMPLE_ROUTING = {"base_model", "model_path", "sampling_session_id", "seq_id", "type"}
_SAMPLE_OFF = {
    "topk_sample_logprobs": 0,
    "target_prompt_logprobs": None,
    "prompt_alt_tokens_k": 0,
}
_SAMPLING_KEYS = ("max_tokens", "seed", "temperature", "top_k", "top_p")
SAMPLE_EXTRA = "prompt_logprobs_last_n"  # a sample body key the engine takes as an argument


def sample_body(req: dict[str, Any], vocab_size: int | None = None) -> dict[str, Any]:
    """Tinker's `SampleRequest` -> the body of our `sample` operation (one prompt), its token
    ids checked against `vocab_size` where it is known.

    `stop`: a string or strings stop on text, token ids on those tokens
    (`stop_token_ids`); None keeps the EOS stop. `[]` (no EOS stop) is refused, as are the
    features we do not serve (top-k of sampled tokens, target / alternative prompt tokens),
    each naming its field. `record_stability_info` is the route's business
    (`trainer.api.tinker.stability`).

    `prompt_logprobs_last_n` (N in [1, len(prompt) - 1], with `prompt_logprobs`) stays in
    the body under its name, for `SAMPLE_EXTRA` to hand the engine: the RL session API's
    sample body has no such field."""
    if not isinstance(req, Mapping):
        raise TinkerInputError("prompt", "the request must be an object")
    known = {
        "prompt",
        "num_samples",
        "sampling_params",
        "prompt_logprobs",
        "topk_prompt_logprobs",
        "record_stability_info",  # the route's business (`stability`)
        "prompt_logprobs_last_n",
    }
    for key in req:
        if key not in known and key not in _SAMPLE_ROUTING and key not in _SAMPLE_OFF:
            raise TinkerInputError(key, "is not a SampleRequest field")
    for key, off in _SAMPLE_OFF.items():
        if req.get(key) not in (off, None, False):
            raise TinkerInputError(key, "is not supported by this worker")
    tokens = token_ids(req.get("prompt"), "prompt", vocab_size)
    num_samples = integer(req.get("num_samples", 1), "num_samples")
    with as_tinker():
        check_num_samples(num_samples)
    topk = integer(_given(req, "topk_prompt_logprobs", 0), "topk_prompt_logprobs")
    with as_tinker():
        check_topk(topk)
    prompt_logprobs = flag(_given(req, "prompt_logprobs", False), "prompt_logprobs")
    body: dict[str, Any] = {
        "model_inputs": [{"chunks": [{"encoded_text": {"tokens": tokens}}]}],
        "num_samples": num_samples,
        "sampling_params": _sampling_params(req.get("sampling_params")),
        "prompt_logprobs": prompt_logprobs,
        "topk_prompt_logprobs": topk,
    }
    if req.get("prompt_logprobs_last_n") is not None:
        last_n = integer(req["prompt_logprobs_last_n"], SAMPLE_EXTRA)
        with as_tinker():
            check_last_n(last_n, [len(tokens)], prompt_logprobs, SAMPLE_EXTRA)
        body[SAMPLE_EXTRA] = last_n
    return body


def _given(req: Mapping[str, Any], key: str, default: Any) -> Any:
    """`req[key]`, or `default` where it is absent or null."""
    value = req.get(key)
    return default if value is None else value


def _sampling_params(raw: Any) -> dict[str, Any]:
    where = "sampling_params"
    if not isinstance(raw, Mapping):
        raise TinkerInputError(where, "must be an object")
    for key in raw:
        if key not in (*_SAMPLING_KEYS, "stop"):
            raise TinkerInputError(f"{where}.{key}", "is not a SamplingParams field")
    out: dict[str, Any] = {}
    for key in ("max_tokens", "seed", "top_k"):
        if raw.get(key) is not None:
            out[key] = integer(raw[key], f"{where}.{key}")
    for key in ("temperature", "top_p"):
        if raw.get(key) is not None:
            out[key] = number(raw[key], f"{where}.{key}")
    if out.get("top_k") == 0:  # Tinker's no-limit is -1; 0 is no value of its top_k
        raise TinkerInputError(f"{where}.top_k", "must be -1 (no limit) or at least 1")
    out.update(_stop(raw.get("stop"), where))
    validated(SamplingParams, out, where, names={"stop_token_ids": "stop"})
    return out


def _stop(stop: Any, where: str) -> dict[str, Any]:
    """Tinker's `stop`: strings stop on text (`stop`), token ids on tokens (`stop_token_ids`)."""
    if stop is None:
        return {}
    if isinstance(stop, str):
        return {"stop": [stop]}
    if not isinstance(stop, list):
        raise TinkerInputError(f"{where}.stop", "must be a string, strings or token ids")
    if not stop:
        raise TinkerInputError(
            f"{where}.stop",
            "[] (no stop at all, not even EOS) is not supported; omit stop to stop at EOS",
        )
    if all(isinstance(s, str) for s in stop):
        return {"stop": list(stop)}
    return {"stop_token_ids": [integer(s, f"{where}.stop[{i}]") for i, s in enumerate(stop)]}


_STOP_REASONS = {"STOP_REASON_STOP": "stop", "STOP_REASON_LENGTH": "length"}


def sample_output(result: dict[str, Any]) -> dict[str, Any]:
    """Our sample result (one prompt) -> the shape `proto.encode_sample_response` takes.

    Prompt logprobs align as Tinker's: entry 0 (the first prompt token has no context) is None,
    entry i the logprob of prompt token i; top-k rows likewise, as (token id, logprob) pairs."""
    (group,) = result["results"]
    sequences = [
        {
            "tokens": [int(t) for t in seq["tokens"]],
            "logprobs": seq.get("logprobs"),
            "stop_reason": _STOP_REASONS[seq["stop_reason"]],
        }
        for seq in group["sequences"]
    ]
    prompt_logprobs = group.get("prompt_logprobs")
    topk = group.get("topk_prompt_logprobs")
    return {
        "sequences": sequences,
        "prompt_logprobs": None
        if prompt_logprobs is None
        else [None, *(None if v is None else float(v) for v in prompt_logprobs[1:])],
        "topk_prompt_logprobs": None if topk is None else [None, *map(_topk_row, topk[1:])],
        "prompt_cache_hit_tokens": 0,
    }


def _topk_row(row: dict[str, Any]) -> list[tuple[int, float]] | None:
    """One position's top-k as (token id, logprob) pairs; None where it was not scored
    (`prompt_logprobs_last_n`), which the engine answers with an empty row."""
    if not row["token_ids"]:
        return None
    return [(int(t), float(v)) for t, v in zip(row["token_ids"], row["logprobs"], strict=True)]
