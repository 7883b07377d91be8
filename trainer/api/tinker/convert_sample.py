"""Tinker's `SampleRequest` to and from the body and result of the engine's `sample` operation.

Split from `trainer.api.tinker.convert` (training conversions), which re-exports these names.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

import numpy as np

from trainer.api.tinker.convert_inputs import (
    TinkerInputError,
    as_tinker,
    flag,
    integer,
    number,
    token_ids,
    validated,
)
from trainer.contract.rules import (
    MAX_TARGET_PROMPT_COLUMNS,
    check_alt_k,
    check_last_n,
    check_num_samples,
    check_target_table,
    check_topk,
)
from trainer.contract.specs import SamplingParams

__all__ = ["SAMPLE_EXTRA", "sample_body", "sample_output"]

# SampleRequest fields that select the model or sequence (the routes' business)
_SAMPLE_ROUTING = {"base_model", "model_path", "sampling_session_id", "seq_id", "type"}
_SAMPLING_KEYS = ("max_tokens", "seed", "temperature", "top_k", "top_p")
SAMPLE_EXTRA = "prompt_logprobs_last_n"  # a sample body key the engine takes as an argument
_MAX_COLUMNS = MAX_TARGET_PROMPT_COLUMNS


def sample_body(req: dict[str, Any], vocab_size: int | None = None) -> dict[str, Any]:
    """Tinker's `SampleRequest` -> the body of our `sample` operation (one prompt), its token
    ids checked against `vocab_size` where it is known.

    `stop`: a string or strings stop on text, token ids on those tokens
    (`stop_token_ids`); None keeps the EOS stop. `[]` (no EOS stop) is refused.
    `record_stability_info` is the route's business (`trainer.api.tinker.stability`).
    `topk_sample_logprobs` is the engine's `sampling_params.top_logprobs`;
    `target_prompt_logprobs` (dense or sparse CSR, -1: nothing) its `target_prompt_ids`;
    `prompt_alt_tokens_k` its own.

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
        "topk_sample_logprobs",
        "target_prompt_logprobs",
        "prompt_alt_tokens_k",
    }
    for key in req:
        if key not in known and key not in _SAMPLE_ROUTING:
            raise TinkerInputError(key, "is not a SampleRequest field")
    tokens = token_ids(req.get("prompt"), "prompt", vocab_size)
    num_samples = integer(req.get("num_samples", 1), "num_samples")
    with as_tinker():
        check_num_samples(num_samples)
    topk = integer(_given(req, "topk_prompt_logprobs", 0), "topk_prompt_logprobs")
    with as_tinker():
        check_topk(topk)
    prompt_logprobs = flag(_given(req, "prompt_logprobs", False), "prompt_logprobs")
    top_sampled = integer(_given(req, "topk_sample_logprobs", 0), "topk_sample_logprobs")
    alt_k = integer(_given(req, "prompt_alt_tokens_k", 0), "prompt_alt_tokens_k")
    with as_tinker():
        check_topk(top_sampled, "topk_sample_logprobs")
        check_alt_k(alt_k)
    params = _sampling_params(req.get("sampling_params"))
    if top_sampled:
        params["top_logprobs"] = top_sampled
    body: dict[str, Any] = {
        "model_inputs": [{"chunks": [{"encoded_text": {"tokens": tokens}}]}],
        "num_samples": num_samples,
        "sampling_params": params,
        "prompt_logprobs": prompt_logprobs,
        "topk_prompt_logprobs": topk,
    }
    if alt_k:
        body["prompt_alt_tokens_k"] = alt_k
    if req.get("target_prompt_logprobs") is not None:
        table = _target_table(req["target_prompt_logprobs"], len(tokens), vocab_size)
        body["target_prompt_ids"] = [table]
    if req.get("prompt_logprobs_last_n") is not None:
        last_n = integer(req["prompt_logprobs_last_n"], SAMPLE_EXTRA)
        with as_tinker():
            check_last_n(last_n, [len(tokens)], prompt_logprobs, SAMPLE_EXTRA)
        body[SAMPLE_EXTRA] = last_n
    return body


_TARGET = "target_prompt_logprobs"


def _target_table(raw: Any, prompt_length: int, vocab_size: int | None) -> list[list[int]]:
    """Tinker's `target_prompt_logprobs` (an int64 `TensorData` `[len(prompt) - 1, K]`, dense
    or sparse CSR whose unlisted cells are -1) as the dense table of ids the engine takes."""
    if not isinstance(raw, Mapping) or not isinstance(raw.get("data"), list):
        raise TinkerInputError(_TARGET, "must be a tensor object with data, dtype and shape")
    if raw.get("dtype") != "int64":
        raise TinkerInputError(f"{_TARGET}.dtype", f"must be int64, got {raw.get('dtype')!r}")
    shape = raw.get("shape")
    if not isinstance(shape, list) or len(shape) != 2:
        raise TinkerInputError(f"{_TARGET}.shape", "must be [len(prompt) - 1, K]")
    rows, columns = (integer(n, f"{_TARGET}.shape") for n in shape)
    if rows != prompt_length - 1 or not 1 <= columns <= _MAX_COLUMNS:
        raise TinkerInputError(
            f"{_TARGET}.shape",
            f"must be [len(prompt) - 1 = {prompt_length - 1}, K] with 1 <= K <= "
            f"{_MAX_COLUMNS}, got {str(shape)[:100]}",
        )
    values = [integer(v, f"{_TARGET}.data[{k}]") for k, v in enumerate(raw["data"])]
    crow, col = raw.get("sparse_crow_indices"), raw.get("sparse_col_indices")
    if crow is None and col is None:
        if len(values) != rows * columns:
            raise TinkerInputError(f"{_TARGET}.data", f"must hold {rows} x {columns} ids")
        table = np.asarray(values, dtype=np.int64).reshape(rows, columns)
    else:
        table = _densify(values, crow, col, rows, columns)
    with as_tinker():
        check_target_table(table.tolist(), prompt_length, vocab_size, _TARGET)
    return [[int(t) for t in row] for row in table]


def _densify(values: list[int], crow: Any, col: Any, rows: int, columns: int) -> np.ndarray:
    """A CSR tensor's cells in a dense [rows, columns] table; unlisted cells -1."""
    if not isinstance(crow, list) or not isinstance(col, list):
        raise TinkerInputError(_TARGET, "sparse_crow_indices and sparse_col_indices go together")
    pointers = [integer(v, f"{_TARGET}.sparse_crow_indices") for v in crow]
    cols = [integer(v, f"{_TARGET}.sparse_col_indices") for v in col]
    ordered = all(a <= b for a, b in itertools.pairwise(pointers))
    if len(pointers) != rows + 1 or pointers[0] != 0 or not ordered:
        raise TinkerInputError(f"{_TARGET}.sparse_crow_indices", f"must be {rows + 1} row pointers")
    if pointers[-1] != len(values) or len(cols) != len(values):
        raise TinkerInputError(_TARGET, "data, sparse_col_indices and row pointers disagree")
    table = np.full((rows, columns), -1, dtype=np.int64)
    for r in range(rows):
        for k in range(pointers[r], pointers[r + 1]):
            if not 0 <= cols[k] < columns:
                raise TinkerInputError(f"{_TARGET}.sparse_col_indices[{k}]", "out of range")
            table[r, cols[k]] = values[k]
    return table


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
    entry i the logprob of prompt token i; top-k rows likewise, as (token id, logprob) pairs,
    and each sequence's `topk_logprobs` (one row per sampled token). `target_prompt_logprobs`
    and `prompt_alt_tokens` come as `TensorData` objects (`_target_tensor`)."""
    (group,) = result["results"]
    sequences = []
    for seq in group["sequences"]:
        out = {
            "tokens": [int(t) for t in seq["tokens"]],
            "logprobs": seq.get("logprobs"),
            "stop_reason": _STOP_REASONS[seq["stop_reason"]],
        }
        if seq.get("top_logprobs") is not None:
            out["topk_logprobs"] = [_topk_row(row) for row in seq["top_logprobs"]]
        sequences.append(out)
    prompt_logprobs = group.get("prompt_logprobs")
    topk = group.get("topk_prompt_logprobs")
    extras: dict[str, Any] = {}
    if group.get("target_prompt_logprobs") is not None:
        extras["target_prompt_logprobs"] = _target_tensor(group["target_prompt_logprobs"])
    alt = group.get("prompt_alt_tokens")
    if alt is not None:
        extras["prompt_alt_tokens"] = {
            "tokens": _dense(alt["token_ids"], "int64"),
            "logprobs": _dense(alt["logprobs"], "float32"),
        }
    return {
        **extras,
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


def _dense(table: list[list[Any]], dtype: str) -> dict[str, Any]:
    """A [N, K] table as a dense `TensorData` object."""
    width = len(table[0]) if table else 0
    return {"data": [v for row in table for v in row], "dtype": dtype, "shape": [len(table), width]}


def _target_tensor(table: list[list[float | None]]) -> dict[str, Any]:
    """The engine's target logprobs (None where no id was asked) as Tinker's float32
    `TensorData`: sparse CSR over the asked cells where the SDK's
    `TensorData.from_torch_sparse(ids, pad_value=-1)` would have sent the ids sparse (the same
    rule, so the same row pointers and columns), else dense with 0.0 where nothing was asked."""
    rows, width = len(table), len(table[0]) if table else 0
    asked = [(r, c, v) for r, row in enumerate(table) for c, v in enumerate(row) if v is not None]
    if (rows + 1) + 2 * len(asked) >= rows * width:
        return _dense([[0.0 if v is None else v for v in row] for row in table], "float32")
    crow = [0] * (rows + 1)
    for r, _, _ in asked:
        crow[r + 1] += 1
    return {
        "data": [v for _, _, v in asked],
        "dtype": "float32",
        "shape": [rows, width],
        "sparse_crow_indices": np.cumsum(crow).tolist(),
        "sparse_col_indices": [c for _, c, _ in asked],
    }
