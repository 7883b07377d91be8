"""Tinker requests and results to and from the engine's operation bodies and results.

Design notes: `docs/design/tinker.md`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import numpy as np

from trainer.api.tinker.convert_inputs import (
    TinkerInputError,
    as_tinker,
    flag,
    integer,
    number,
    table_shape,
    tensor_values,
    token_ids,
    validated,
)
from trainer.api.tinker.stability import Provenance, parse_spans
from trainer.contract.base import Spec
from trainer.contract.losses import LOSS_SPECS, TOKEN_INPUTS
from trainer.contract.optimizer import AdamParams
from trainer.contract.rules import (
    Needs,
    check_inputs,
    check_last_n,
    check_num_samples,
    check_same_columns,
    check_topk,
)
from trainer.contract.specs import SamplingParams

__all__ = [
    "SAMPLE_EXTRA",
    "TinkerInputError",
    "forward_backward_body",
    "forward_backward_output",
    "optim_step_body",
    "optim_step_output",
    "sample_body",
    "sample_output",
]

FBI = "forward_backward_input"


@dataclass(frozen=True)
class _TinkerLoss:
    """A Tinker loss as one of the registry's (`LOSS_SPECS`): what only Tinker says about it.
    Its inputs are the registry's for that loss, plus `extra`."""

    loss_type: str  # the engine's loss
    # `loss_fn_config` keys with Tinker's defaults (None: no default, so required)
    knobs: dict[str, float | None] = field(default_factory=dict)
    fixed: dict[str, Any] = field(default_factory=dict)  # engine params Tinker does not expose
    ones: bool = False  # a datum may omit the loss's required inputs: all ones (CE's weights)
    extra: tuple[str, ...] = ()  # Tinker-only inputs, mapped before the engine sees them
    # the datums carry provenance spans: the inputs the registry says this face builds
    # (`LossSpec.built`) come from the records they name (`trainer.api.tinker.stability`)
    provenance: bool = False


# Tinker's clip defaults (ε_low = ε_high = 0.2 in its loss docs)
_TINKER_CLIP: dict[str, float | None] = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
_TINKER_LOSSES = {
    "cross_entropy": _TinkerLoss("LOSS_TYPE_CROSS_ENTROPY", ones=True),
    "importance_sampling": _TinkerLoss("LOSS_TYPE_IMPORTANCE_SAMPLING"),
    "ppo": _TinkerLoss("LOSS_TYPE_PPO", _TINKER_CLIP),
    "cispo": _TinkerLoss("LOSS_TYPE_CISPO", _TINKER_CLIP),
    "dro": _TinkerLoss("LOSS_TYPE_DRO", {"beta": None}),
    "gspo": _TinkerLoss(
        "LOSS_TYPE_GRPO",
        _TINKER_CLIP,
        fixed={
            "beta": 0.0,
            "ratio_type": "GRPO_LOSS_RATIO_TYPE_SEQUENCE",
            "agg_type": "GRPO_LOSS_AGGREGATION_TYPE_FIXED_HORIZON",
        },
        extra=("sequence_ratio_mask",),
    ),
    # the sampler's logprobs are the records', not the datum's (docs/semantics.md §13)
    "stable_reinforce": _TinkerLoss(
        "LOSS_TYPE_STABLE_REINFORCE", {"kl_coeff": 0.0, "truncation": 2.0}, provenance=True
    ),
}
_REFUSED = {
    "custom": "server-side custom losses are not supported; use forward_backward_custom, which "
    "computes the loss on the client",
}


def _config(fbi: Mapping[str, Any], loss_fn: str, tinker: _TinkerLoss) -> dict[str, float]:
    """`loss_fn_config` checked against the loss's Tinker knobs, with Tinker's defaults filled
    in (their bounds are the registry's params class's, checked by `_loss`)."""
    raw = fbi.get("loss_fn_config") or {}
    if not isinstance(raw, Mapping):
        raise TinkerInputError(f"{FBI}.loss_fn_config", "must be an object")
    for key in raw:
        if key not in tinker.knobs:
            allowed = sorted(tinker.knobs) or "none"
            raise TinkerInputError(
                f"{FBI}.loss_fn_config.{key}",
                f"is not a knob of {loss_fn} (its knobs: {allowed})",
            )
    out: dict[str, float] = {}
    for key, default in tinker.knobs.items():
        if raw.get(key) is not None:
            out[key] = number(raw[key], f"{FBI}.loss_fn_config.{key}")
        elif default is not None:
            out[key] = default
    return out


# --------------------------------------------------------------------------------------------
# forward / forward_backward
# --------------------------------------------------------------------------------------------


def _loss(tinker: _TinkerLoss, config: dict[str, float]) -> tuple[dict[str, Any], Spec]:
    """Our `loss` body, and its params parsed by the registry's class: a bound it breaks is
    refused as the `loss_fn_config` field."""
    spec = LOSS_SPECS[tinker.loss_type]
    params = {**config, **tinker.fixed}
    parsed = validated(spec.params_cls, params, f"{FBI}.loss_fn_config")
    body: dict[str, Any] = {"type": tinker.loss_type}
    if params:
        body[spec.params_key] = params
    return body, parsed


def _tinker_loss(fbi: Mapping[str, Any]) -> tuple[str, _TinkerLoss]:
    loss_fn = fbi.get("loss_fn")
    if not isinstance(loss_fn, str):
        raise TinkerInputError(f"{FBI}.loss_fn", f"must be a loss name, got {str(loss_fn)[:100]}")
    if loss_fn in _REFUSED:
        raise TinkerInputError(f"{FBI}.loss_fn", _REFUSED[loss_fn])
    if loss_fn not in _TINKER_LOSSES:
        raise TinkerInputError(
            f"{FBI}.loss_fn", f"unknown loss {loss_fn!r}; one of {sorted(_TINKER_LOSSES)}"
        )
    return loss_fn, _TINKER_LOSSES[loss_fn]


def forward_backward_body(
    fbi: dict[str, Any], forward_only: bool, vocab_size: int | None = None
) -> dict[str, Any]:
    """`forward_backward_request`'s body alone (a loss without provenance)."""
    return forward_backward_request(fbi, forward_only, vocab_size)[0]


def forward_backward_request(
    fbi: dict[str, Any], forward_only: bool, vocab_size: int | None = None
) -> tuple[dict[str, Any], list[Provenance] | None]:
    """Tinker's `forward_backward_input` -> the body of our `forward-backward` operation, and
    for `stable_reinforce` each datum's provenance spans, which `stability.resolve` turns into
    the body's `logprobs` and `mask` (None for every other loss).

    `fbi` is `{"data": [Datum], "loss_fn": str, "loss_fn_config": dict | None}` as JSON or as
    `proto.decode_forward_backward_request` returns it; token ids (model inputs and target
    tokens) are checked against `vocab_size` where it is known. The body asks for per-token
    logprobs at every position (`logprobs_unmasked`). Raises `TinkerInputError` naming the
    field (`forward_only` too: a JSON boolean).
    """
    forward_only = flag(forward_only, "forward_only")
    if not isinstance(fbi, Mapping):
        raise TinkerInputError(FBI, "must be an object")
    loss_fn, tinker = _tinker_loss(fbi)
    loss, params = _loss(tinker, _config(fbi, loss_fn, tinker))
    data = fbi.get("data")
    if not isinstance(data, list) or not data:
        raise TinkerInputError(f"{FBI}.data", "must be a non-empty list of datums")
    needs = Needs.of_loss(tinker.loss_type, params, by=f"loss {loss_fn}")
    built = LOSS_SPECS[tinker.loss_type].built
    if built:
        needs = replace(needs, required=tuple(n for n in needs.required if n not in built))
    reads = _Reads(needs, tinker, vocab_size)
    datums = [_datum(d, f"{FBI}.data[{i}]", reads) for i, d in enumerate(data)]
    targets = [inputs["target_tokens"] for _, inputs in datums]
    columns = [int(t.shape[1]) if t.ndim == 2 else None for t in targets]
    with as_tinker():
        check_same_columns(columns, lambda i: f"{FBI}.data[{i}].loss_fn_inputs.target_tokens")
    provenance = (
        [_provenance(d, f"{FBI}.data[{i}]", datums[i]) for i, d in enumerate(data)]
        if tinker.provenance
        else None
    )
    if loss_fn == "gspo":
        _gspo_inputs(datums)
    samples = []
    for tokens, inputs in datums:
        loss_fn_inputs = {name: _body_tensor(name, values) for name, values in inputs.items()}
        samples.append(
            {
                "model_input": {"chunks": [{"encoded_text": {"tokens": tokens}}]},
                "loss_fn_inputs": loss_fn_inputs,
            }
        )
    body = {
        "loss": loss,
        "samples": samples,
        "forward_only": forward_only,
        "return_loss_fn_outputs": True,
        "logprobs_unmasked": True,
    }
    return body, provenance


def _provenance(
    datum: Mapping[str, Any], where: str, parsed: tuple[list[int], dict[str, np.ndarray]]
) -> Provenance:
    """A datum's spans over its model input and over its targets, each tiling its field."""
    tokens, inputs = parsed
    length = len(tokens)
    cap = 2 * length + 2  # zero-length runs are allowed, a flood of them is not
    return Provenance(
        parse_spans(datum.get("model_input_spans"), f"{where}.model_input_spans", length, cap),
        parse_spans(
            datum.get("loss_fn_input_spans"),
            f"{where}.loss_fn_input_spans",
            len(inputs["target_tokens"]),
            cap,
        ),
    )


def _body_tensor(name: str, values: np.ndarray) -> dict[str, Any]:
    """One input of our body: flat data, with `shape` for `[T, K]` soft targets."""
    dtype = "int64" if name in TOKEN_INPUTS else "float32"
    tensor: dict[str, Any] = {"data": values.reshape(-1), "dtype": dtype}
    if values.ndim == 2:
        tensor["shape"] = list(values.shape)
    return tensor


_DATUM_KEYS = {"model_input", "loss_fn_inputs", "model_input_spans", "loss_fn_input_spans"}


class _Reads(NamedTuple):
    """What every datum of a call is read against: its loss's needs, and the vocabulary."""

    needs: Needs
    tinker: _TinkerLoss
    vocab_size: int | None


class _Parsed(NamedTuple):
    """A parsed Tinker tensor as the rules read it: float inputs go out as float32; `shape`
    is `[T, K]` for soft targets (flat `data`), else None."""

    dtype: str
    data: np.ndarray
    shape: list[int] | None = None


def _datum(datum: Any, where: str, call: _Reads) -> tuple[list[int], dict[str, np.ndarray]]:
    """One datum's tokens and its loss inputs, as arrays (int64 ids, float64 the rest; `[T]`,
    or `[T, K]` for cross entropy's soft targets), checked by the engine's rules
    (`check_inputs`) under the datum's Tinker path."""
    needs, tinker = call.needs, call.tinker
    if not isinstance(datum, Mapping):
        raise TinkerInputError(where, "must be an object")
    for key in datum:
        if key not in _DATUM_KEYS:
            raise TinkerInputError(f"{where}.{key}", "is not a Datum field")
    tokens = token_ids(datum.get("model_input"), f"{where}.model_input", call.vocab_size)
    raw = datum.get("loss_fn_inputs") or {}
    if not isinstance(raw, Mapping):
        raise TinkerInputError(f"{where}.loss_fn_inputs", "must be an object")
    built = LOSS_SPECS[tinker.loss_type].built  # sent or not, replaced from the records
    reads = [*dict.fromkeys(("target_tokens", *needs.required, *tinker.extra, *built))]
    reads += [rule.input for rule in needs.rules if rule.input not in reads]
    for name in raw:
        if name not in reads:
            raise TinkerInputError(
                f"{where}.loss_fn_inputs.{name}",
                f"is not an input of this loss (it reads {reads})",
            )
    inputs: dict[str, _Parsed] = {}
    for name in reads:
        if name in raw:
            inputs[name] = _parsed(name, raw[name], f"{where}.loss_fn_inputs.{name}")
        elif tinker.ones and name in needs.required:  # shaped as the targets
            target = inputs.get("target_tokens")
            shape = None if target is None else target.shape
            count = len(tokens) if shape is None else shape[0] * shape[1]
            inputs[name] = _Parsed("float32", np.ones(count), shape)
    with as_tinker():
        targets = check_inputs(where, len(tokens), inputs, needs, call.vocab_size)
    values = {
        name: parsed.data.reshape(targets.shape) if parsed.shape else parsed.data
        for name, parsed in inputs.items()
    }
    return tokens, {**values, "target_tokens": targets}


def _parsed(name: str, tensor: Any, field: str) -> _Parsed:
    """A Tinker tensor parsed: token ids as int64 (in the dtype sent, which the rules check),
    any other input as float64 values, sent on as float32."""
    values = tensor_values(tensor, field)
    shape = table_shape(tensor.get("shape"), values.size)
    if name not in TOKEN_INPUTS:
        return _Parsed("float32", values, shape)
    if np.any(values != np.trunc(values)):
        raise TinkerInputError(f"{field}.dtype", "token ids must be int64")
    return _Parsed(str(tensor.get("dtype")), values.astype(np.int64), shape)


def _gspo_inputs(datums: list[tuple[list[int], dict[str, np.ndarray]]]) -> None:
    """`sequence_ratio_mask` -> our mask; advantages scaled by num_samples · H (module doc)."""
    scale = float(len(datums) * max(len(tokens) for tokens, _ in datums))
    for i, (tokens, inputs) in enumerate(datums):
        ratio_mask = inputs.pop("sequence_ratio_mask", np.ones(len(tokens)))
        outside = np.flatnonzero((ratio_mask == 0) & (inputs["advantages"] != 0))
        if outside.size:
            raise TinkerInputError(
                f"{FBI}.data[{i}].loss_fn_inputs.advantages",
                f"is non-zero at position {int(outside[0])}, outside sequence_ratio_mask; gspo "
                "here sums only the positions of sequence_ratio_mask",
            )
        inputs["mask"] = (ratio_mask != 0).astype(np.float64)
        inputs["advantages"] = inputs["advantages"] * scale
        if np.abs(inputs["advantages"]).max() > np.finfo(np.float32).max:
            raise TinkerInputError(
                f"{FBI}.data[{i}].loss_fn_inputs.advantages", "too large for gspo in float32"
            )


def _metric_name(name: str) -> str:
    """Our metric name with the reduction suffix the SDK combines chunks by (`name:sum`)."""
    base = name.replace(":", "/")
    if base == "loss/tokens":
        return f"{base}:sum"
    return f"{base.removesuffix('/mean')}:mean"


def forward_backward_output(result: dict[str, Any], loss_fn: str) -> dict[str, Any]:
    """Our forward-backward result -> Tinker's `ForwardBackwardOutput` shape:
    `{"loss_fn_output_type": "ArrayRecord", "loss_fn_outputs": [{"logprobs": float32 array}],
    "metrics": {"loss:sum": loss, ...}}`. Every metric name carries one reduction suffix
    (`:sum` or `:mean`), so the SDK combines chunked calls. The result must hold its
    `loss_fn_outputs` (read an offloaded payload first)."""
    if "loss_fn_outputs" not in result:
        raise ValueError("the result has no loss_fn_outputs (read its payload first)")
    outputs = [
        {"logprobs": _logprobs(out["tensors"]["logprobs"])} for out in result["loss_fn_outputs"]
    ]
    metrics = {_metric_name(k): float(v) for k, v in (result.get("metrics") or {}).items()}
    metrics["loss:sum"] = float(result["loss"])
    return {"loss_fn_output_type": "ArrayRecord", "loss_fn_outputs": outputs, "metrics": metrics}


def _logprobs(tensor: dict[str, Any]) -> np.ndarray:
    """A datum's logprobs: `[N]`, or `[N, K]` for soft targets (one per target token)."""
    return np.asarray(tensor["data"], dtype=np.float32).reshape(tensor.get("shape") or [-1])


# --------------------------------------------------------------------------------------------
# optim_step
# --------------------------------------------------------------------------------------------

# Tinker's `AdamParams` defaults (the SDK sends every field; these fill a hand-written body)
_TINKER_ADAM = {
    "learning_rate": 1e-4,
    "beta1": 0.9,
    "beta2": 0.95,
    "eps": 1e-12,
    "weight_decay": 0.0,
    "grad_clip_norm": 0.0,
}


def optim_step_body(req: dict[str, Any]) -> dict[str, Any]:
    """Tinker's `OptimStepRequest` -> our `optim-step` body `{"adam_params": {...}}`.

    The params come as `adam_params`, `optimizer_params` or `optim_params`; only AdamW is
    served (a `dimuon` or other family is a `TinkerInputError` naming `optim_params.type`)."""
    if not isinstance(req, Mapping):
        raise TinkerInputError("optim_params", "the request must be an object")
    given = [k for k in ("adam_params", "optimizer_params", "optim_params") if k in req]
    if len(given) != 1:
        raise TinkerInputError("adam_params", "send exactly one of adam_params / optimizer_params")
    key = given[0]
    params = req[key]
    if not isinstance(params, Mapping):
        raise TinkerInputError(key, "must be an object")
    family = params.get("type", "adamw")
    if family != "adamw":
        raise TinkerInputError(
            "optim_params.type", f"optimizer {family!r} is not served; this worker trains AdamW"
        )
    for name in params:
        if name not in _TINKER_ADAM and name != "type":
            raise TinkerInputError(f"{key}.{name}", "is not an AdamParams field")
    adam = {name: params.get(name, default) for name, default in _TINKER_ADAM.items()}
    for name, value in adam.items():
        number(value, f"{key}.{name}")
    validated(AdamParams, adam, key)
    return {"adam_params": adam}


def optim_step_output(result: dict[str, Any]) -> dict[str, Any]:
    """Our optim-step result -> Tinker's `OptimStepResponse`: `{"metrics": {...}}` with our
    metric names (`grad_norm` before clipping, `grad_norm_clipped`, `learning_rate`, ...)."""
    metrics = result.get("metrics") or {}
    return {
        "metrics": {
            name: float(value)
            for name, value in metrics.items()
            if isinstance(value, int | float) and not isinstance(value, bool)
        }
    }


# --------------------------------------------------------------------------------------------
# sample
# --------------------------------------------------------------------------------------------

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
