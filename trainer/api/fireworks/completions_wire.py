"""The completions wire (`POST /inference/v1/completions`): the request, checked field by field
(a 400 naming the field), its engine `sample` body, and the choices built from the engine's
sequences, in the shapes the Fireworks SDK's `DeploymentSampler` reads (docs/semantics.md §25).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Any

from trainer.api.fireworks.response_format import parse_response_format
from trainer.contract.grammar import OutputGrammar
from trainer.contract.routing import FORMAT as ROUTING_FORMAT
from trainer.contract.specs import STOP_CANCELLED, STOP_LENGTH, STOP_STOP
from trainer.serving.errors import ApiError, bad_request

MAX_TOP_LOGPROBS = 20
MAX_N = 128
DEFAULT_MAX_TOKENS = 16

IGNORED = ("prompt_cache_key", "reset_prompt_cache", "user", "return_token_ids", "stream_options")
"""Accepted and without effect: this worker keeps no prompt cache, serves no users by name,
and always returns the prompt's token ids."""

NEUTRAL = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "ignore_eos": False,
}
"""Accepted at the value that leaves sampling as it is; any other value is a 400 naming it."""


def extra_field(name: str) -> ApiError:
    """An unknown field, in the message the SDK recognises for an unsupported option
    (`_unsupported_routing_format`, `_unsupported_top_sampling_format`)."""
    shown = name[:80]
    return ApiError(
        400,
        f"Extra inputs are not permitted, field: '{shown}'",
        param=shown,
        code="invalid_request_error",
    )


@dataclass
class CompletionRequest:
    model: str
    prompt: list[int] | str
    n: int = 1
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off (the engine's -1)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0
    echo: bool = False
    echo_last: int | None = None
    raw_output: bool = False
    stream: bool = False
    perf_metrics: bool = False
    # R3: each logprob row's MoE experts (`routing_matrix`, docs/semantics.md §12)
    routing_matrix: bool = False
    response_format: OutputGrammar | None = None  # docs/semantics.md §17.2

    @property
    def drawn(self) -> int:
        """The tokens the engine draws: `max_tokens`, or one for a scored prompt (0), which
        the answer drops (`scored_only`)."""
        return max(self.max_tokens, 1)

    def echo_count(self, prompt_len: int) -> int:
        """How many of the prompt's last tokens come back before the completion."""
        if self.echo_last is not None:
            return min(self.echo_last, prompt_len)
        return prompt_len if self.echo else 0

    def echoed(self, prompt: list[int]) -> list[int]:
        """The prompt's last tokens that come back before the completion."""
        return prompt[len(prompt) - self.echo_count(len(prompt)) :]


# The request's fields: the request's own, by the wire's names (where the two differ: the stop
# ids come in `stop`, `perf_metrics` is `perf_metrics_in_response`), then the accepted ones.
FIELDS = {f.name for f in fields(CompletionRequest)}
FIELDS -= {"stop_token_ids", "perf_metrics", "routing_matrix"}
FIELDS |= {"perf_metrics_in_response", "include_routing_matrix", "routing_matrix_format"}
FIELDS |= {*IGNORED, *NEUTRAL}


def _bool(req: dict[str, Any], name: str, default: bool = False) -> bool:
    value = req.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name}: must be a boolean", name)
    return value


def _int(req: dict[str, Any], name: str, default: int | None, lo: int, hi: int) -> int | None:
    value = req.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{name}: must be an integer", name)
    if not lo <= value <= hi:
        raise bad_request(f"{name}: {value} is out of range [{lo}, {hi}]", name)
    return value


def _float(req: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = req.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad_request(f"{name}: must be a number", name)
    if not lo <= float(value) <= hi:  # NaN fails both
        raise bad_request(f"{name}: {value} is out of range [{lo}, {hi}]", name)
    return float(value)


def _prompt(value: Any) -> list[int] | str:
    if isinstance(value, str):
        if not value:
            raise bad_request("prompt: must not be empty", "prompt")
        return value
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], list | str):
        return _prompt(value[0])  # a batch of one prompt
    if not isinstance(value, list) or not value:
        raise bad_request("prompt: a non-empty list of token ids, or a string", "prompt")
    for i, token in enumerate(value):
        if isinstance(token, list | str):
            raise bad_request(
                "prompt: one prompt per request (send one request per prompt)", "prompt"
            )
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise bad_request(f"prompt[{i}]: must be a token id (an integer >= 0)", f"prompt[{i}]")
    return list(value)


def _stop(value: Any) -> tuple[list[str], list[int]]:
    if value is None:
        return [], []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise bad_request("stop: a string, or a list of strings and token ids", "stop")
    strings: list[str] = []
    ids: list[int] = []
    for i, item in enumerate(items):
        if isinstance(item, str) and item:
            strings.append(item)
        elif isinstance(item, int) and not isinstance(item, bool) and item >= 0:
            ids.append(item)
        else:
            raise bad_request(
                f"stop[{i}]: must be a non-empty string or a token id (an integer >= 0)",
                f"stop[{i}]",
            )
    return strings, ids


def parse_request(req: dict[str, Any]) -> CompletionRequest:
    """The request checked field by field; a 400 naming the first field that is wrong."""
    for name in req:
        if name not in FIELDS:
            raise extra_field(name)
    if req.get("routing_matrix_format") not in (None, ROUTING_FORMAT):  # e.g. parquet_v1
        raise extra_field("routing_matrix_format")  # the SDK then falls back to base64_inline
    for name, neutral in NEUTRAL.items():
        value = req.get(name)
        if value is not None and (value != neutral or type(value) is not type(neutral)):
            raise bad_request(f"{name}: only {neutral!r} is served (sampling as it is)", name)
    model = req.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model: name the model to sample (a string)", "model")
    if "prompt" not in req:
        raise bad_request("prompt: required", "prompt")
    logprobs_value = req.get("logprobs")
    if isinstance(logprobs_value, int) and not isinstance(logprobs_value, bool):
        top = _int(req, "logprobs", 0, 0, MAX_TOP_LOGPROBS)  # legacy: an int k is top-k
        logprobs = True
    else:
        logprobs, top = _bool(req, "logprobs"), 0
    asked_top = _int(req, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if asked_top is not None:
        top = asked_top
        logprobs = logprobs or asked_top > 0
    routing = _bool(req, "include_routing_matrix") or "routing_matrix_format" in req
    if routing and not logprobs:
        raise bad_request(
            "include_routing_matrix: needs logprobs (each token's matrix is on its "
            "logprobs.content row)",
            "include_routing_matrix",
        )
    stop, stop_ids = _stop(req.get("stop"))
    n = _int(req, "n", 1, 1, MAX_N)
    max_tokens = _int(req, "max_tokens", DEFAULT_MAX_TOKENS, 0, 1 << 31)
    top_k = _int(req, "top_k", 0, 0, 1 << 31)
    assert n is not None and max_tokens is not None and top_k is not None and top is not None
    if max_tokens == 0:  # scoring the prompt (docs/semantics.md §25)
        if not _bool(req, "echo") and not req.get("echo_last"):
            raise bad_request(
                "max_tokens: 0 scores the prompt alone, and needs echo (or echo_last) to "
                "return it; send 1 or more to generate",
                "max_tokens",
            )
        if _bool(req, "stream"):
            raise bad_request(
                "stream: a prompt scored alone (max_tokens 0) is not streamed", "stream"
            )
    return CompletionRequest(
        model=model,
        prompt=_prompt(req["prompt"]),
        n=n,
        max_tokens=max_tokens,
        temperature=_float(req, "temperature", 1.0, 0.0, 100.0),
        top_p=_float(req, "top_p", 1.0, 0.0, 1.0),
        top_k=top_k,
        seed=_int(req, "seed", None, 0, (1 << 63) - 1),
        stop=stop,
        stop_token_ids=stop_ids,
        logprobs=logprobs,
        top_logprobs=top if logprobs else 0,
        echo=_bool(req, "echo"),
        echo_last=_int(req, "echo_last", None, 0, 1 << 31),
        raw_output=_bool(req, "raw_output"),
        stream=_bool(req, "stream"),
        perf_metrics=_bool(req, "perf_metrics_in_response"),
        routing_matrix=routing,
        response_format=parse_response_format(req.get("response_format")),
    )


def engine_body(req: CompletionRequest, prompt: list[int]) -> dict[str, Any]:
    """The engine's `sample` body (`SampleBody`) for one prompt."""
    params: dict[str, Any] = {
        "max_tokens": req.drawn,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k or -1,
        "stop": req.stop,
        "stop_token_ids": req.stop_token_ids,
    }
    if req.seed is not None:
        params["seed"] = req.seed
    if req.logprobs and req.top_logprobs:
        params["top_logprobs"] = req.top_logprobs
    body: dict[str, Any] = {
        "model_inputs": [{"chunks": [{"encoded_text": {"tokens": prompt}}]}],
        "num_samples": req.n,
        "sampling_params": params,
    }
    if req.logprobs:
        body["sampling_logprobs"] = True
        if req.echo_count(len(prompt)):
            body["prompt_logprobs"] = True
            body["topk_prompt_logprobs"] = req.top_logprobs
    return body


# The engine's field names -> the completion's, most specific first
_WIRE_NAMES = (
    (r"model_inputs\[0\](\.chunks\[0\]\.encoded_text\.tokens)?", "prompt"),
    (r"sampling_params\.top_k", "top_k"),
    (r"sampling_params\.stop_token_ids", "stop"),
    (r"sampling_params\.([a-z_]+)", r"\1"),
    (r"topk_prompt_logprobs", "top_logprobs"),
    (r"num_samples", "n"),
    (r"return_routing_matrices", "include_routing_matrix"),
)


def wire_names(text: str) -> str:
    for ours, theirs in _WIRE_NAMES:
        text = re.sub(rf"(?<![\w.\]]){ours}", theirs, text)
    return text


def wire_error(exc: ApiError) -> ApiError:
    """An engine check's 400 with the completion's field names."""
    param = None if exc.param is None else wire_names(exc.param)
    return ApiError(exc.status, wire_names(exc.message), param=param, code=exc.code)


def scored_only(req: CompletionRequest, group: dict[str, Any]) -> dict[str, Any]:
    """A `max_tokens: 0` request's engine result without the token its call drew: the prompt
    alone, as if generation stopped at its length (`length`)."""
    if req.max_tokens:
        return group
    empty: dict[str, Any] = {
        "tokens": [],
        "logprobs": [],
        "sampling_logprobs": [],
        "top_logprobs": [],
    }
    sequences = [{**seq, **empty, "stop_reason": STOP_LENGTH} for seq in group["sequences"]]
    return {**group, "sequences": sequences}


def finish_reason(stop_reason: str) -> str:
    """`stop` for EOS, a stop string or id; `length` at `max_tokens` (and for a generation the
    client ended, which only a closed stream sees)."""
    return "stop" if stop_reason == STOP_STOP else "length"


def cancelled(stop_reason: str) -> bool:
    return stop_reason == STOP_CANCELLED


# -- the answer ------------------------------------------------------------------------------


@dataclass
class Tokens:
    """Token ids to text: the whole (`text`) and one token (`piece`), by the model's tokenizer
    (none: the ids in angle brackets, so a model without a tokenizer still answers)."""

    tokenizer: Any

    def text(self, ids: list[int], skip_special: bool = True) -> str:
        if not ids:
            return ""
        if self.tokenizer is None:
            return "".join(f"<{i}>" for i in ids)
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special))

    def piece(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"<{token_id}>"
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))


def _top(tokens: Tokens, ids: list[int], values: list[float]) -> list[dict[str, Any]]:
    out = []
    for i, v in zip(ids, values, strict=True):
        piece = tokens.piece(int(i))
        out.append({"token_id": int(i), "token": piece, "logprob": float(v), "bytes": _utf8(piece)})
    return out


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def _row(
    tokens: Tokens,
    token_id: int,
    logprob: float,
    sampling: float | None,
    top: list[dict[str, Any]],
) -> dict[str, Any]:
    piece = tokens.piece(token_id)
    return {
        "token": piece,
        "token_id": token_id,
        "bytes": _utf8(piece),
        "logprob": logprob,
        "sampling_logprob": sampling,
        "top_logprobs": top,
    }


def logprob_rows(
    req: CompletionRequest,
    tokens: Tokens,
    prompt: list[int],
    group: dict[str, Any],
    seq: dict[str, Any],
) -> list[dict[str, Any]]:
    """`logprobs.content`: the echoed prompt tokens' rows (the model's logprob of each given
    its prefix; the first prompt token, which has none, gets 0.0 and itself as its top-1: it
    is given), then one row per generated token; each with its `routing_matrix` when asked.
    A row's `text_offset` counts the rows' token strings before it, as vLLM does."""
    rows = _rows(req, tokens, prompt, group, seq)
    offset = 0
    for row in rows:
        row["text_offset"] = offset
        offset += len(row["token"])
    if req.routing_matrix:
        _add_routes(rows, len(prompt) - req.echo_count(len(prompt)), seq)
    return rows


def raw_output(
    req: CompletionRequest, tokens: Tokens, prompt: list[int], fragments: list[Any], seq: dict
) -> dict[str, Any]:
    """`raw_output`: the prompt as the model saw it (`fragments`: the text or ids it was made
    of), and the completion's ids (the echoed prompt's first) and text, special tokens kept."""
    generated = [int(t) for t in seq["tokens"]]
    return {
        "prompt_fragments": fragments,
        "prompt_token_ids": prompt,
        "completion": tokens.text(generated, skip_special=False),
        "completion_token_ids": req.echoed(prompt) + generated,
    }


def _add_routes(rows: list[dict[str, Any]], first: int, seq: dict[str, Any]) -> None:
    """Row r (the token at position `first + r` of prompt + completion) gets the matrix of
    the position before it: the forward that scored and drew that token, so a row's matrix
    goes with its logprob. The first prompt token has none: ""."""
    matrices = seq.get("routing_matrices") or []
    for r, row in enumerate(rows):
        at = first + r - 1
        row["routing_matrix"] = matrices[at] if 0 <= at < len(matrices) else ""


def _rows(
    req: CompletionRequest,
    tokens: Tokens,
    prompt: list[int],
    group: dict[str, Any],
    seq: dict[str, Any],
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    echo = req.echo_count(len(prompt))
    prompt_lps = group.get("prompt_logprobs") or []
    prompt_top = group.get("topk_prompt_logprobs") or []
    for i in range(len(prompt) - echo, len(prompt)):
        top: list[dict[str, Any]] = []
        if i == 0:
            logprob = 0.0
            top = _top(tokens, [prompt[0]], [0.0]) if req.top_logprobs else []
        else:
            logprob = float(prompt_lps[i])
            if req.top_logprobs:
                top = _top(tokens, prompt_top[i]["token_ids"], prompt_top[i]["logprobs"])
        rows.append(_row(tokens, prompt[i], logprob, None, top))
    sampling = seq.get("sampling_logprobs") or []
    tops = seq.get("top_logprobs") or []
    for j, token_id in enumerate(seq["tokens"]):
        top = _top(tokens, tops[j]["token_ids"], tops[j]["logprobs"]) if j < len(tops) else []
        drawn = float(sampling[j]) if j < len(sampling) else None
        rows.append(_row(tokens, int(token_id), float(seq["logprobs"][j]), drawn, top))
    return rows


def choice_json(
    index: int,
    req: CompletionRequest,
    tokens: Tokens,
    prompt: list[int],
    group: dict[str, Any],
    seq: dict[str, Any],
    text: str,
) -> dict[str, Any]:
    """One choice, whole (`text`: all of it, or the rest a stream has not sent)."""
    out: dict[str, Any] = {
        "index": index,
        "text": text,
        "finish_reason": finish_reason(seq["stop_reason"]),
        "logprobs": None,
        "prompt_token_ids": prompt,
    }
    if req.logprobs:
        rows = logprob_rows(req, tokens, prompt, group, seq)
        out["logprobs"] = {
            "content": rows,
            "tokens": [row["token"] for row in rows],
            "token_logprobs": [row["logprob"] for row in rows],
            "text_offset": [row["text_offset"] for row in rows],
        }
    if req.raw_output:
        fragments = [req.prompt] if isinstance(req.prompt, str) else list(prompt)
        out["raw_output"] = raw_output(req, tokens, prompt, fragments, seq)
    return out


def full_text(req: CompletionRequest, tokens: Tokens, prompt: list[int], seq: dict) -> str:
    return tokens.text(req.echoed(prompt)) + tokens.text([int(t) for t in seq["tokens"]])
