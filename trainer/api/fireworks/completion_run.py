"""One completion from request to answer, for both completion routes (`completions.py`, the
text route, and `chat.py`, the chat route; docs/semantics.md §25): the `model` resolved to an
engine session (`targets.py`), the prompt rendered by the route's `Shape`, the engine `sample`
call (queued behind the session's other operations, counted for the caller's user and quotas,
merged with its concurrent peers: `completion_batch.py`), the target released once the
operation has ended, and the answer, whole or streamed, in the route's shapes.

A stream sends each choice's new text after each decode step (the engine's `watch`), then per
choice a last chunk with its finish reason, logprobs and `raw_output`, then `usage` (and
`perf_metrics`) and `[DONE]`. A client that closes the stream ends the generation at the next
decode step.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response, StreamingResponse

from trainer.api.fireworks.auth import principal_of
from trainer.api.fireworks.completion_batch import FanOut, Merger
from trainer.api.fireworks.completion_stream import ChoiceStream
from trainer.api.fireworks.completions_wire import (
    CompletionRequest,
    Tokens,
    cancelled,
    engine_body,
    scored_only,
    wire_error,
)
from trainer.api.fireworks.targets import Target
from trainer.api.tinker.bridge import RequestFailed, TinkerBridge
from trainer.contract.rules import Limits
from trainer.contract.specs import ModelEntry
from trainer.serving.errors import ApiError, bad_request
from trainer.serving.operations import (
    OPERATIONS,
    router_replay_of,
    run_to_end,
    tokenizer_of,
    validated_call,
    vocab_size_of,
)
from trainer.serving.tenants import is_quota_refusal
from trainer.serving.worker import EngineCall, Worker

REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
FIELD_FIRST = re.compile(r"^[a-z_][\w.\[\]]*: ")  # an engine refusal's message names its field
POLL_S = 0.25  # how often a waiting stream checks that its client is still there
FLUSH_S = 0.02  # a stream writes at most one chunk this often (the first at once); the decode
# loop never waits for it: what it made meanwhile goes out in the next chunk


class Watch:
    """The engine's `SampleWatch` of one completion: records when the first token came, hands
    each step's new tokens to the stream (`sink`, from the engine thread), and says stop once
    the client has gone."""

    def __init__(self, sink: Any = None) -> None:
        self.sink = sink
        self.cancel = threading.Event()
        self.first_token_at: float | None = None
        self.seen: list[int] = []

    def stopped(self) -> bool:
        return self.cancel.is_set()

    def step(self, sequences: list[Any]) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
            self.seen = [0] * len(sequences)
        if self.sink is None:
            return
        new = [list(seq.tokens[self.seen[r] :]) for r, seq in enumerate(sequences)]
        self.seen = [len(seq.tokens) for seq in sequences]
        self.sink(new)


class Shape(Protocol):
    """What tells the two routes apart: how the prompt is made, and the answer's shapes."""

    id_prefix: str  # of the answer's `id`
    object: str  # the answer's `object`
    chunk_object: str  # a stream chunk's `object`

    def prompt(
        self, req: CompletionRequest, tokenizer: Any, entry: ModelEntry
    ) -> tuple[CompletionRequest, list[int]]:
        """The prompt's token ids, and the request with what the prompt settles (a 400 naming
        the field when the prompt cannot be made)."""
        ...

    def choice(self, ready: Prepared, group: dict[str, Any], i: int) -> dict[str, Any]:
        """Choice `i` of a whole answer (its sequence: `group["sequences"][i]`)."""
        ...

    def stream(self, ready: Prepared, i: int) -> ChoiceStream:
        """How choice `i` is streamed (`completion_stream.py`)."""
        ...

    def extra(self, ready: Prepared) -> dict[str, Any]:
        """Fields of the whole answer beside `choices` and `usage`."""
        ...


@dataclass
class Prepared:
    """A completion ready to run: its prompt, engine call and tokenizer."""

    req: CompletionRequest
    target: Target
    prompt: list[int]
    call: EngineCall
    tokens: Tokens
    body: dict[str, Any]  # the engine body `call` was validated from
    entry: ModelEntry
    vocab: int | None
    watch: Watch
    merge_key: str | None  # completions of one key run as one call (completion_batch.py)
    shape: Shape
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    started: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.id = self.id or f"{self.shape.id_prefix}{uuid.uuid4().hex}"

    def head(self, chunk: bool = False) -> dict[str, Any]:
        kind = self.shape.chunk_object if chunk else self.shape.object
        return {"id": self.id, "object": kind, "created": self.created, "model": self.req.model}


def _prepare(
    bridge: TinkerBridge,
    req: CompletionRequest,
    target: Target,
    watch: Watch,
    user: str,
    shape: Shape,
) -> Prepared:
    worker = bridge.worker
    entry = bridge.entry(target.base_model, "model")
    tokenizer = tokenizer_of(worker, target.base_model)
    req, prompt = shape.prompt(req, tokenizer, entry)
    if len(prompt) + req.drawn > entry.max_seq_length:
        raise bad_request(
            f"max_tokens: {len(prompt)} prompt tokens + max_tokens {req.drawn} exceed the "
            f"context length {entry.max_seq_length} of {entry.name}",
            "max_tokens",
        )
    if req.routing_matrix and router_replay_of(worker, target.base_model) is False:
        raise bad_request(
            f"include_routing_matrix: {entry.name} has no mixture-of-experts layers whose "
            "routes this worker records",
            "include_routing_matrix",
        )
    extra = {"watch": watch, **_extras(req)}
    vocab = vocab_size_of(worker, target.base_model)
    body = engine_body(req, prompt)
    try:
        call = validated_call(
            OPERATIONS["sample"], body, entry, None, vocab, extra, tokenizer is not None
        )
    except ApiError as exc:
        raise wire_error(exc) from None
    key = None
    if req.seed is None:  # a seeded request's draws are its seed's alone
        settings = {k: v for k, v in body.items() if k != "model_inputs"}
        grammar = req.response_format
        constraint = None if grammar is None else [grammar.kind, grammar.text]
        key = json.dumps(
            [target.session_id, user, settings, _routes(req), constraint], sort_keys=True
        )
    tokens = Tokens(tokenizer)
    return Prepared(req, target, prompt, call, tokens, body, entry, vocab, watch, key, shape)


def _routes(req: CompletionRequest) -> dict[str, Any]:
    """The engine's ask for each sequence's routes inline (R3), when the request asks."""
    return {"return_routing_matrices": True} if req.routing_matrix else {}


def _extras(req: CompletionRequest) -> dict[str, Any]:
    """The sample's engine arguments beyond its body: the routes (R3) and the grammar the
    text must match (`response_format`), when the request asks."""
    grammar = {} if req.response_format is None else {"grammar": req.response_format}
    return {**_routes(req), **grammar}


def engine_error(error: dict[str, Any]) -> ApiError:
    """A failed sample operation as the completion's answer, decided by the engine's code."""
    code = str(error.get("code", "")).removeprefix("TRAINING_OPERATION_ERROR_CODE_")
    message = str(error.get("message", "the sample failed"))
    param = error.get("param")
    if not isinstance(param, str) and FIELD_FIRST.match(message):  # "field: why"
        param = message.split(":", 1)[0]
    named = wire_error(ApiError(400, message, param=param if isinstance(param, str) else None))
    if code == "INVALID_INPUT":
        return ApiError(400, named.message, param=named.param, code="invalid_request_error")
    if code == "NON_FINITE_LOSS":  # this target's weights give NaN/inf logits, not the worker
        return ApiError(422, f"model: {message}", param="model", code="non_finite_logits")
    if is_quota_refusal(message):
        return ApiError(429, message, code="quota_exceeded")
    if code == "SESSION_NOT_ACTIVE":
        return ApiError(503, f"{message}; send the request again", code="unavailable")
    return ApiError(500, f"{code}: {message}", code="internal_error")


def _run(worker: Worker, merger: Merger, ready: Prepared) -> dict[str, Any]:
    """Queue the sample on the target's session (with the completions it merges with), wait
    for it; its prompt's result. The target is released once the operation has ended,
    whatever its outcome."""
    try:
        return merger.run(ready.merge_key, ready, lambda ms: sample(worker, ms), _fits)
    finally:
        ready.target.release()


def _fits(members: list[Prepared]) -> bool:
    """Whether these completions' prompts make one sample call within the model's limits
    (its rows and its tokens per call, as the rulebook counts them)."""
    first = members[0]
    limits = Limits.of(first.entry, vocab_size=first.vocab)
    n, max_tokens = first.req.n, first.req.drawn  # what the engine call draws
    if len(members) * n > limits.max_batch_size:
        return False
    budget = limits.max_tokens_per_call
    return budget is None or n * sum(len(m.prompt) + max_tokens for m in members) <= budget


def sample(worker: Worker, members: list[Prepared]) -> dict[str, Any]:
    """One sample operation of the members' prompts, in order: its output."""
    first = members[0]
    call = first.call
    if len(members) > 1:
        body = {**first.body, "model_inputs": [m.body["model_inputs"][0] for m in members]}
        watch = FanOut([m.watch for m in members], first.req.n)
        extra = {"watch": watch, **_extras(first.req)}
        tokenizer_known = first.tokens.tokenizer is not None
        call = validated_call(
            OPERATIONS["sample"], body, first.entry, None, first.vocab, extra, tokenizer_known
        )
    session_id = first.target.session_id
    key = f"completions:{first.id}"
    error, output = run_to_end(worker, session_id, "sample", key, key, call)
    if error is not None:
        raise engine_error(error)
    return output


def _usage(ready: Prepared, group: dict[str, Any]) -> dict[str, int]:
    completion = sum(len(seq["tokens"]) for seq in group["sequences"])
    prompt = len(ready.prompt)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _perf(ready: Prepared, watch: Watch, completion_tokens: int) -> dict[str, Any]:
    """Server timings, under the names the SDK's `ServerMetrics` reads."""
    now = time.monotonic()
    out: dict[str, Any] = {
        "server-processing-time": round(now - ready.started, 6),
        "prompt-tokens": len(ready.prompt),
        "cached-prompt-tokens": 0,
    }
    first = watch.first_token_at
    if first is not None:
        decode_s = now - first
        out["server-time-to-first-token"] = round(first - ready.started, 6)
        out["generation-duration"] = round(decode_s, 6)
        decoded = completion_tokens - ready.req.n  # the first token of each row is prefill's
        if decode_s > 0 and decoded > 0:
            out["decode-tokens-per-second"] = round(decoded / decode_s, 3)
    return out


def _answer(ready: Prepared, group: dict[str, Any], watch: Watch) -> dict[str, Any]:
    shape = ready.shape
    choices = [shape.choice(ready, group, i) for i in range(len(group["sequences"]))]
    usage = _usage(ready, group)
    out = {**ready.head(), "choices": choices, "usage": usage, **shape.extra(ready)}
    if ready.req.perf_metrics:
        out["perf_metrics"] = _perf(ready, watch, usage["completion_tokens"])
    return out


def _request_id(request: Request) -> str:
    given = request.headers.get("x-request-id", "")
    return given if REQUEST_ID.fullmatch(given) else uuid.uuid4().hex


async def serve(request: Request, req: CompletionRequest, shape: Shape, started: float) -> Response:
    """A checked request from start to answer (the route's body, after its own parsing;
    `started`: when the route began, where the server's time counts from in `perf_metrics`)."""
    bridge: TinkerBridge = request.app.state.tinker
    targets = request.app.state.fireworks.targets
    merger: Merger = request.app.state.fireworks.merger
    who = principal_of(request)
    headers = {"x-request-id": _request_id(request)}
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    def sink(new: list[list[int]]) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, ("step", new))

    watch = Watch(sink if req.stream else None)
    try:
        target = await run_in_threadpool(targets.resolve, req.model, who)
    except RequestFailed as exc:
        raise ApiError(503, f"model: {exc.message}", param="model", code="unavailable") from None
    try:
        ready = await run_in_threadpool(_prepare, bridge, req, target, watch, who.user, shape)
    except BaseException:
        target.release()
        raise
    ready.started = started
    if not req.stream:
        group = await run_in_threadpool(_run, bridge.worker, merger, ready)
        return JSONResponse(_answer(ready, scored_only(ready.req, group), watch), headers=headers)

    task = asyncio.ensure_future(run_in_threadpool(_run, bridge.worker, merger, ready))
    task.add_done_callback(lambda t: queue.put_nowait(("done", t)))
    task.add_done_callback(_seen)  # a stream closed early never reads its outcome
    first = await queue.get()
    if first[0] == "done" and first[1].exception() is not None:
        raise first[1].exception()  # before the first byte: the answer's own status
    stream = _stream(request, ready, watch, queue, first)
    return StreamingResponse(stream, media_type="text/event-stream", headers=headers)


def _seen(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def _stream(
    request: Request,
    ready: Prepared,
    watch: Watch,
    queue: asyncio.Queue[tuple[str, Any]],
    first: tuple[str, Any],
) -> AsyncIterator[str]:
    req, head = ready.req, ready.head(chunk=True)
    streams = [ready.shape.stream(ready, i) for i in range(req.n)]
    made: list[list[int]] = [[] for _ in streams]  # the tokens each choice has generated
    try:
        opening = [chunk for s in streams if (chunk := s.opening()) is not None]
        if opening:
            yield _sse({**head, "choices": opening})
        event: tuple[str, Any] | None = first
        while event is not None and event[0] == "step":
            fresh, event = _coalesced(event[1], queue)
            deltas = []
            for i, new in enumerate(fresh[: len(streams)]):
                made[i].extend(new)
                if new and (chunk := streams[i].step(made[i])) is not None:
                    deltas.append(chunk)
            if deltas:
                yield _sse({**head, "choices": deltas})
            if event is None:
                flushed = time.monotonic()
                event = await _next(request, watch, queue)
                wait = FLUSH_S - (time.monotonic() - flushed)
                if event[0] == "step" and wait > 0:
                    await asyncio.sleep(wait)  # then `_coalesced` takes what came meanwhile
        assert event is not None
        done: asyncio.Future[dict[str, Any]] = event[1]
        error = done.exception()
        if error is not None:
            yield _sse(_error_chunk(head, error))
            return
        group = done.result()
        for i, seq in enumerate(group["sequences"]):
            if cancelled(seq["stop_reason"]):
                return  # the client ended it: nobody reads the rest
            yield _sse({**head, "choices": [streams[i].end(group, seq)]})
        usage = _usage(ready, group)
        last: dict[str, Any] = {**head, "choices": [], "usage": usage}
        if req.perf_metrics:
            last["perf_metrics"] = _perf(ready, watch, usage["completion_tokens"])
        yield _sse(last)
        yield "data: [DONE]\n\n"
    finally:
        watch.cancel.set()  # a no-op once the generation is over


def _coalesced(
    new: list[list[int]], queue: asyncio.Queue[tuple[str, Any]]
) -> tuple[list[list[int]], tuple[str, Any] | None]:
    """`new` with the steps already queued behind it, row by row (one chunk for what the
    decode loop made while the last one was written), and the event after them, if queued."""
    merged = [list(row) for row in new]
    while not queue.empty():
        event = queue.get_nowait()
        if event[0] != "step":
            return merged, event
        for row, more in zip(merged, event[1], strict=True):
            row.extend(more)
    return merged, None


async def _next(
    request: Request, watch: Watch, queue: asyncio.Queue[tuple[str, Any]]
) -> tuple[str, Any]:
    """The next event of the generation; a client that left stops it (then only its end)."""
    while True:
        try:
            return await asyncio.wait_for(queue.get(), POLL_S)
        except TimeoutError:
            if not watch.cancel.is_set() and await request.is_disconnected():
                watch.cancel.set()


def _error_chunk(head: dict[str, Any], error: BaseException) -> dict[str, Any]:
    """A failure after the stream began, as the SDK reads it (`_UpstreamStreamError`)."""
    if isinstance(error, ApiError):
        status, message, code = error.status, error.message, error.code
    else:
        status, message, code = 500, f"{type(error).__name__}: {error}", "internal_error"
    return {**head, "error": {"message": message, "code": code, "status_code": status}}
