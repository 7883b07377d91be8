"""Tinker requests and results to and from the engine's operation bodies and results
(training: forward, forward-backward, optim-step; sampling is in `convert_sample`).

A forward-only call (the SDK's `forward`, or `forward_backward` with `forward_only`) reads
the `loss_fn_inputs` its loss reads and ignores any other (the Fireworks cookbook's reference
forward sends `loss_mask`, advantages, ...); a forward-backward refuses them, naming the field
(docs/semantics.md §23). Design notes: `docs/design/tinker.md`.
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
    number,
    routing_matrices,
    table_shape,
    tensor_values,
    token_ids,
    validated,
)
from trainer.api.tinker.convert_sample import SAMPLE_EXTRA, sample_body, sample_output
from trainer.api.tinker.stability import Provenance, parse_spans
from trainer.contract.base import Spec
from trainer.contract.losses import LOSS_SPECS, TOKEN_INPUTS
from trainer.contract.optimizer import AdamParams
from trainer.contract.rules import (
    Needs,
    check_inputs,
    check_same_columns,
)

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
    # `ratio_log_cap`: the Fireworks cookbook's distillation recipe sends it (unset: no cap)
    "importance_sampling": _TinkerLoss("LOSS_TYPE_IMPORTANCE_SAMPLING", {"ratio_log_cap": None}),
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
    # the registry's DPPO (docs/semantics.md §1), with its own defaults
    "dppo": _TinkerLoss("LOSS_TYPE_DPPO", {"delta_low": 0.15, "delta_high": 0.15}),
    # the sampler's logprobs are the records', not the datum's (docs/semantics.md §13)
    "stable_reinforce": _TinkerLoss(
        "LOSS_TYPE_STABLE_REINFORCE", {"kl_coeff": 0.0, "truncation": 2.0}, provenance=True
    ),
}
_REFUSED = {
    "custom": "server-side custom losses are not supported; use forward_backward_custom, which "
    "computes the loss on the client",
}
# loss names the Fireworks SDK knows (`types/loss_fn_type.py`) whose semantics no loss of our
# registry defines: refused, naming what is served
_UNDEFINED = ("dapo", "reinforce")
# `loss_fn_config` keys the Fireworks SDK reads, accepted where they ask for what this worker
# computes anyway (`target_logprob_support`: logprobs over the full vocabulary)
_CONFIG_DEFAULTS = {"target_logprob_support": "full_vocabulary"}


def _config(fbi: Mapping[str, Any], loss_fn: str, tinker: _TinkerLoss) -> dict[str, float]:
    """`loss_fn_config` checked against the loss's Tinker knobs, with Tinker's defaults filled
    in (their bounds are the registry's params class's, checked by `_loss`)."""
    raw = fbi.get("loss_fn_config") or {}
    if not isinstance(raw, Mapping):
        raise TinkerInputError(f"{FBI}.loss_fn_config", "must be an object")
    for key in raw:
        if key in _CONFIG_DEFAULTS and raw[key] in (None, _CONFIG_DEFAULTS[key]):
            continue
        if key in _CONFIG_DEFAULTS:
            raise TinkerInputError(
                f"{FBI}.loss_fn_config.{key}",
                f"only {_CONFIG_DEFAULTS[key]!r} is served, got {str(raw[key])[:100]!r}",
            )
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
        why = (
            "is not served: no loss of this worker defines its semantics"
            if loss_fn in _UNDEFINED
            else "is unknown"
        )
        raise TinkerInputError(
            f"{FBI}.loss_fn", f"{loss_fn[:100]!r} {why}; served: {sorted(_TINKER_LOSSES)}"
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
    reads = _Reads(needs, tinker, vocab_size, forward_only)
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
    for i, (tokens, inputs) in enumerate(datums):
        loss_fn_inputs = {name: _body_tensor(name, values) for name, values in inputs.items()}
        sample: dict[str, Any] = {
            "model_input": {"chunks": [{"encoded_text": {"tokens": tokens}}]},
            "loss_fn_inputs": loss_fn_inputs,
        }
        where = f"{FBI}.data[{i}].model_input"
        routes = routing_matrices(data[i]["model_input"], where, len(tokens))
        if routes is not None:  # R3: these experts are forced (docs/semantics.md §12)
            sample["routing_matrices"] = routes
        samples.append(sample)
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
    forward_only: bool = False  # inputs the loss does not read are ignored (module doc)


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
    if call.forward_only:  # a forward reads what its loss reads; the rest is ignored
        raw = {name: value for name, value in raw.items() if name in reads}
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
        if name not in _TINKER_ADAM and name not in ("type", "emit_grad_norm_metrics"):
            raise TinkerInputError(f"{key}.{name}", "is not an AdamParams field")
    emit = params.get("emit_grad_norm_metrics")  # grad_norm is always reported
    if emit is not None and emit not in (True, False, "off", "basic", "detailed"):
        raise TinkerInputError(
            f"{key}.emit_grad_norm_metrics", "must be a boolean, 'off', 'basic' or 'detailed'"
        )
    adam = {name: params.get(name, default) for name, default in _TINKER_ADAM.items()}
    for name, value in adam.items():
        number(value, f"{key}.{name}")
    validated(AdamParams, adam, key)
    return {"adam_params": adam}


GRAD_NORMALIZATIONS = ("num_loss_tokens", "num_sequences", "none")


def grad_normalization(req: Mapping[str, Any]) -> str | None:
    """The Fireworks SDK's `grad_accumulation_normalization` of an optim_step request: None
    (absent, null or `none`: the gradients as accumulated), `num_loss_tokens` or
    `num_sequences` (docs/semantics.md §23: what the accumulated gradient is divided by)."""
    value = req.get("grad_accumulation_normalization")
    if value is None:
        return None
    if not isinstance(value, str) or value.lower() not in GRAD_NORMALIZATIONS:
        raise TinkerInputError(
            "grad_accumulation_normalization", f"must be one of {list(GRAD_NORMALIZATIONS)}"
        )
    return None if value.lower() == "none" else value.lower()


# the names the Fireworks cookbook reads for two of ours (`training/utils/rl/metrics.py`)
_OPTIM_ALIASES = {"learning_rate": "lr", "grad_norm_clipped": "grad_norm_post_clip"}


def optim_step_output(result: dict[str, Any]) -> dict[str, Any]:
    """Our optim-step result -> Tinker's `OptimStepResponse`: `{"metrics": {...}}` with our
    metric names (`grad_norm` before clipping, `grad_norm_clipped`, `learning_rate`, ...) and,
    beside two of them, the Fireworks cookbook's (`lr`, `grad_norm_post_clip`)."""
    metrics = {
        name: float(value)
        for name, value in (result.get("metrics") or {}).items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    }
    for ours, theirs in _OPTIM_ALIASES.items():
        if ours in metrics:
            metrics[theirs] = metrics[ours]
    return {"metrics": metrics}
