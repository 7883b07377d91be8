"""`POST /inference/v1/completions` (and `/v1/completions`): token-in, token-out completions on
any sampling target of the worker (docs/semantics.md §25).

The request is checked here (`completions_wire.parse_request`); the `model` resolves to an
engine session and the sample runs as its `sample` operation in `completion_run.serve`, which
the chat route shares. This module holds what is the text route's own: a prompt of token ids
or a string, and choices with `text`.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from trainer.api.fireworks.completion_run import Prepared, serve
from trainer.api.fireworks.completion_stream import ChoiceStream, TextStream
from trainer.api.fireworks.completions_wire import (
    CompletionRequest,
    choice_json,
    full_text,
    parse_request,
)
from trainer.api.http import json_object
from trainer.contract.specs import ModelEntry
from trainer.serving.errors import bad_request

router = APIRouter()


class TextShape:
    """The legacy completion: `text_completion` objects whose choices carry `text`."""

    id_prefix = "cmpl-"
    object = "text_completion"
    chunk_object = "text_completion"

    def prompt(
        self, req: CompletionRequest, tokenizer: Any, entry: ModelEntry
    ) -> tuple[CompletionRequest, list[int]]:
        if not isinstance(req.prompt, str):
            return req, req.prompt
        if tokenizer is None:
            raise bad_request(f"prompt: {entry.name} has no tokenizer; send token ids", "prompt")
        return req, [int(t) for t in tokenizer.encode(req.prompt)]

    def choice(self, ready: Prepared, group: dict[str, Any], i: int) -> dict[str, Any]:
        seq = group["sequences"][i]
        text = full_text(ready.req, ready.tokens, ready.prompt, seq)
        return choice_json(i, ready.req, ready.tokens, ready.prompt, group, seq, text)

    def delta(self, ready: Prepared, i: int, text: str, first: bool) -> dict[str, Any]:
        return {"index": i, "text": text, "finish_reason": None}

    def last(self, ready: Prepared, group: dict[str, Any], i: int, rest: str, first: bool) -> Any:
        seq = group["sequences"][i]
        return choice_json(i, ready.req, ready.tokens, ready.prompt, group, seq, rest)

    def stream(self, ready: Prepared, i: int) -> ChoiceStream:
        return TextStream(self, ready, i)

    def extra(self, ready: Prepared) -> dict[str, Any]:
        return {}


TEXT = TextShape()


@router.post("/inference/v1/completions", response_model=None)
@router.post("/v1/completions", response_model=None)
async def completions(request: Request) -> Response:
    started = time.monotonic()
    bridge = request.app.state.tinker
    raw = await json_object(request, bridge.worker.config.max_body_bytes)
    return await serve(request, parse_request(raw), TEXT, started)
