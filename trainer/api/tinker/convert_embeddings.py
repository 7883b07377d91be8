"""The Fireworks SDK's embedding calls on the Tinker routes (docs/semantics.md §27): a `forward` or
`forward_backward` whose `loss_fn_config` has an `output` (`embedding`,
`cos_similarity_matrix`, `contrastive_loss`) becomes our `embedding-forward-backward` body, and
its result the SDK's `ForwardBackwardOutput`.

The SDK sends `loss_fn: "cross_entropy"` with the config: the config decides. A forward reads
the datums' tokens and ignores their `loss_fn_inputs`; a backward of `embedding` or
`cos_similarity_matrix` reads one `embedding_grads` per datum, and `contrastive_loss` reads none.
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
    tensor_values,
    token_ids,
)
from trainer.contract.embeddings import OUTPUTS, check_embedding_width, takes_gradients

FBI = "forward_backward_input"
CONFIG = f"{FBI}.loss_fn_config"
GRADS = "embedding_grads"
_KNOBS = ("output", "pooling", "num_queries", "temperature", "num_extra_negatives")


def is_embedding(fbi: Any) -> bool:
    """Whether a `forward_backward_input` asks for an embedding output."""
    config = fbi.get("loss_fn_config") if isinstance(fbi, Mapping) else None
    return isinstance(config, Mapping) and config.get("output") is not None


def embedding_body(
    fbi: Mapping[str, Any], forward_only: Any, vocab: int | None, hidden: int | None = None
) -> dict[str, Any]:
    """Our `embedding-forward-backward` body (module docstring); a `TinkerInputError` names
    the request's field. `vocab`, `hidden`: the model's vocabulary and hidden state width,
    where known (the engine checks them again)."""
    forward_only = flag(forward_only, "forward_only")
    if fbi.get("loss_fn") != "cross_entropy":
        raise TinkerInputError(
            f"{FBI}.loss_fn",
            "an embedding output is asked with loss_fn cross_entropy (as the SDK sends it)",
        )
    objective = _objective(fbi["loss_fn_config"])
    data = fbi.get("data")
    if not isinstance(data, list) or not data:
        raise TinkerInputError(f"{FBI}.data", "must be a non-empty list of datums")
    takes = takes_gradients(objective["output"], forward_only)
    samples, gradients = [], []
    for i, datum in enumerate(data):
        where = f"{FBI}.data[{i}]"
        if not isinstance(datum, Mapping):
            raise TinkerInputError(where, "must be an object")
        tokens = token_ids(datum.get("model_input"), f"{where}.model_input", vocab)
        samples.append({"model_input": {"chunks": [{"encoded_text": {"tokens": tokens}}]}})
        inputs = datum.get("loss_fn_inputs") or {}
        if not isinstance(inputs, Mapping):
            raise TinkerInputError(f"{where}.loss_fn_inputs", "must be an object")
        if forward_only:
            continue  # a forward reads the tokens only
        for name in inputs:
            if name != GRADS or not takes:
                reads = [GRADS] if takes else []
                raise TinkerInputError(
                    f"{where}.loss_fn_inputs.{name}",
                    f"is not read by {objective['output']} (it reads {reads})",
                )
        if takes:
            if GRADS not in inputs:
                raise TinkerInputError(f"{where}.loss_fn_inputs.{GRADS}", "is required")
            field = f"{where}.loss_fn_inputs.{GRADS}"
            values = tensor_values(inputs[GRADS], field)
            if objective["output"] == "embedding":
                with as_tinker():
                    check_embedding_width(values.size, hidden, f"{field}.data")
            gradients.append({"data": values})
    body: dict[str, Any] = {
        "samples": samples,
        "objective": objective,
        "forward_only": forward_only,
    }
    if takes:
        body["gradients"] = gradients
    return body


def _objective(config: Mapping[str, Any]) -> dict[str, Any]:
    for key in config:
        if key not in _KNOBS:
            raise TinkerInputError(
                f"{CONFIG}.{key}", f"is not read with an embedding output (it reads {_KNOBS})"
            )
    output = config["output"]
    if output == "projection":
        raise TinkerInputError(
            f"{CONFIG}.output",
            "'projection' reads a projection head, which this worker does not serve "
            "(create_model's projection_head_dim)",
        )
    if output not in OUTPUTS:
        raise TinkerInputError(f"{CONFIG}.output", f"must be one of {list(OUTPUTS)}")
    objective: dict[str, Any] = {"output": output}
    pooling = config.get("pooling")
    if pooling is not None:
        if pooling not in ("mean", "last"):
            raise TinkerInputError(f"{CONFIG}.pooling", "must be 'mean' or 'last'")
        objective["pooling"] = pooling
    for key in ("num_queries", "num_extra_negatives"):
        if config.get(key) is not None:
            objective[key] = integer(_whole(config[key]), f"{CONFIG}.{key}")
    if config.get("temperature") is not None:
        objective["temperature"] = number(config["temperature"], f"{CONFIG}.temperature")
    return objective


def _whole(value: Any) -> Any:
    """A count sent as a float (a protobuf `loss_fn_config` map holds doubles) as an int."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def embedding_output(result: dict[str, Any], count: int) -> dict[str, Any]:
    """Our result -> the SDK's `ForwardBackwardOutput`: per datum its `embedding` (a vector,
    or a row of the similarity matrix; nothing after a backward or for `contrastive_loss`),
    and the metrics with their reduction suffix (`loss:sum`, the rest `:mean`)."""
    rows = result.get("outputs")
    outputs: list[dict[str, Any]] = (
        [{"embedding": row} for row in rows] if rows is not None else [{} for _ in range(count)]
    )
    metrics = {
        f"{name}:{'sum' if name == 'loss' else 'mean'}": float(value)
        for name, value in (result.get("metrics") or {}).items()
    }
    return {"loss_fn_output_type": "ArrayRecord", "loss_fn_outputs": outputs, "metrics": metrics}
