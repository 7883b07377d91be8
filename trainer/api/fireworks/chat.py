"""`POST /inference/v1/chat/completions` (and `/v1/chat/completions`): chat completions on any
sampling target of the worker, as the Fireworks SDK's `chat.completions.create` and the
OpenAI client send them (docs/semantics.md §25a).

The messages are rendered with the model's own chat template (`apply_chat_template`, the
generation prompt added) and tokenized without added special tokens; from there the request is
a completion of those token ids (`completion_run.serve`, shared with the text route): the same
sampling, logprobs, echo, merging and streaming. This module holds what is the chat route's
own: the messages, the fields only chat has, and choices with a `message` (with the calls of
offered tools parsed out of it: `chat_tools.py`; a required or named call held to the template's
call format: `tool_choice.py`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import jinja2
from fastapi import APIRouter, Request
from fastapi.responses import Response

from trainer.api.fireworks.chat_harmony import Harmony
from trainer.api.fireworks.chat_reasoning import (
    EFFORTS,
    FIELDS,
    REASONING,
    check_budget,
    template_switch,
    thinking_asked,
    thinking_budget,
)
from trainer.api.fireworks.chat_stream import CallStream, ChannelStream
from trainer.api.fireworks.chat_think import (
    THINK_END,
    Thinking,
    Thinks,
    Thought,
    budgeted,
    thinking_first,
)
from trainer.api.fireworks.chat_tools import HERMES, check_template, parse_calls, parse_tools
from trainer.api.fireworks.chat_truncate import fit, parse_truncate_len
from trainer.api.fireworks.completion_run import Prepared, serve
from trainer.api.fireworks.completion_stream import ChoiceStream, TextStream
from trainer.api.fireworks.completions_wire import (
    CompletionRequest,
    extra_field,
    finish_reason,
    logprob_rows,
    parse_request,
    raw_output,
)
from trainer.api.fireworks.tool_choice import (
    TAGS,
    Forced,
    calls_grammar,
    check_forced,
    parse_choice,
)
from trainer.api.http import json_object
from trainer.contract.specs import ModelEntry
from trainer.serving.errors import ApiError, bad_request

router = APIRouter()

ROLES = ("system", "developer", "user", "assistant", "tool")
MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content"}
IGNORED = ("metadata",)  # accepted and without effect
NOT_SERVED = {
    "functions": "the legacy function fields are not served; send tools",
    "function_call": "the legacy function fields are not served; send tools",
    "reasoning_effort": REASONING,
    "thinking": REASONING,
}
"""Chat fields this worker cannot honour: a 400 naming the field, never a silent drop."""


def _content(value: Any, i: int, role: str, calls: bool) -> str | None:
    """A message's content as text: a string, or its text parts joined."""
    where = f"messages[{i}].content"
    if value is None:
        if role == "assistant" and calls:
            return None
        raise bad_request(f"{where}: required (a string or a list of text parts)", where)
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad_request(f"{where}: a string or a list of text parts", where)
    texts: list[str] = []
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise bad_request(
                f"{where}[{j}].type: {str(kind)[:40]!r} is not served; this worker serves text "
                "models, so a part is {'type': 'text', 'text': ...}",
                f"{where}[{j}].type",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise bad_request(f"{where}[{j}].text: must be a string", f"{where}[{j}].text")
        texts.append(text)
    return "".join(texts)


def parse_messages(value: Any) -> list[dict[str, Any]]:
    """The conversation, checked message by message (a 400 naming the first field that is
    wrong), each content as one string."""
    if not isinstance(value, list) or not value:
        raise bad_request("messages: a non-empty list of messages", "messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise bad_request(f"messages[{i}]: must be an object", f"messages[{i}]")
        for key in message:
            if key not in MESSAGE_KEYS:
                raise extra_field(f"messages[{i}].{key}")
        role = message.get("role")
        if role not in ROLES:
            raise bad_request(
                f"messages[{i}].role: {str(role)[:40]!r} is not one of {', '.join(ROLES)}",
                f"messages[{i}].role",
            )
        for key in ("name", "tool_call_id", "reasoning_content"):
            if key in message and not isinstance(message[key], str | None):
                raise bad_request(f"messages[{i}].{key}: must be a string", f"messages[{i}].{key}")
        calls = message.get("tool_calls")
        if calls is not None and not isinstance(calls, list):
            where = f"messages[{i}].tool_calls"
            raise bad_request(f"{where}: must be a list", where)
        content = _content(message.get("content"), i, str(role), bool(calls))
        kept = {k: v for k, v in message.items() if v is not None}
        if calls:
            kept["tool_calls"] = [_call_sent(call, i, j) for j, call in enumerate(calls)]
        out.append({**kept, "content": content})
    return out


def _call_sent(call: Any, i: int, j: int) -> Any:
    """An assistant message's tool call as its template reads it: `function.arguments` a JSON
    object, as a completion's calls send it written out (a string), parsed back, as vLLM
    does (a 400 naming it when it is not one)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    arguments: str = function["arguments"]
    where = f"messages[{i}].tool_calls[{j}].function.arguments"
    try:
        parsed = json.loads(arguments)
    except ValueError:
        raise bad_request(f"{where}: not a JSON object: {arguments[:80]!r}", where) from None
    if not isinstance(parsed, dict):
        raise bad_request(f"{where}: not a JSON object: {arguments[:80]!r}", where)
    return {**call, "function": {**function, "arguments": parsed}}


def _max_tokens(raw: dict[str, Any]) -> Any:
    """`max_completion_tokens`, or `max_tokens` (the older name); both given must agree."""
    newer, older = raw.get("max_completion_tokens"), raw.get("max_tokens")
    if newer is not None and older is not None and newer != older:
        raise bad_request(
            f"max_completion_tokens: {newer!r} disagrees with max_tokens {older!r}; send one",
            "max_completion_tokens",
        )
    return newer if newer is not None else older


def parse_chat(raw: dict[str, Any]) -> tuple[CompletionRequest, ChatShape]:
    """The chat request checked field by field: the completion it is, and its shape."""
    for name, why in NOT_SERVED.items():
        value = raw.get(name)
        if value is None:
            continue
        if thinking_asked(name, value) is not None:
            continue
        if name == "reasoning_effort" and isinstance(value, str) and value in EFFORTS:
            continue
        raise bad_request(f"{name}: not served: {why}", name)
    if raw.get("reasoning_effort") is not None and raw.get("thinking") is not None:
        raise bad_request("thinking: send it or reasoning_effort, not both", "thinking")
    if raw.get("context_length_exceeded_behavior") not in (None, "error"):
        raise bad_request(
            "context_length_exceeded_behavior: only 'error' is served (a prompt past the "
            "context is a 400, never truncated)",
            "context_length_exceeded_behavior",
        )
    if "prompt" in raw:
        raise extra_field("prompt")  # the text route's field
    forced = parse_choice(raw.get("tool_choice"))
    tools = parse_tools(raw)
    if forced is not None:
        check_forced(forced, tools)
        if raw.get("response_format") is not None:
            message = "tool_choice: a required or named call is its own constraint; send it or "
            raise bad_request(message + "response_format, not both", "tool_choice")
    messages = parse_messages(raw.get("messages"))
    token_ids = raw.get("return_token_ids")
    if token_ids is not None and not isinstance(token_ids, bool):
        raise bad_request("return_token_ids: must be a boolean", "return_token_ids")
    chat_only = {*NOT_SERVED, *IGNORED, "messages", "max_completion_tokens", "tools", "tool_choice"}
    chat_only |= {"context_length_exceeded_behavior", "return_token_ids", "prompt_truncate_len"}
    body = {k: v for k, v in raw.items() if k not in chat_only}
    body["prompt"] = [0]  # the rendered messages take its place (`ChatShape.prompt`)
    body.pop("max_tokens", None)
    asked = _max_tokens(raw)
    if asked is not None:
        body["max_tokens"] = asked
    try:
        req = parse_request(body)
    except ApiError as exc:
        if exc.param == "max_tokens" and raw.get("max_completion_tokens") is not None:
            message = exc.message.replace("max_tokens", "max_completion_tokens", 1)
            raise bad_request(message, "max_completion_tokens") from None
        raise
    thinking = next(
        ((n, on) for n in FIELDS if (on := thinking_asked(n, raw.get(n))) is not None), None
    )
    effort = raw.get("reasoning_effort")
    effort = effort if isinstance(effort, str) and effort in EFFORTS else None
    shape = ChatShape(
        messages,
        asked is not None,
        bool(token_ids),
        thinking,
        tools=tools,
        effort=effort,
        forced=forced,
        truncate_len=parse_truncate_len(raw.get("prompt_truncate_len")),
        budget=thinking_budget(raw),
    )
    return req, shape


def _finish(stop_reason: str, called: bool) -> str:
    """`tool_calls` for a completion that called tools and ended; one cut by `max_tokens`
    stays `length`, its last call perhaps cut with it."""
    reason = finish_reason(stop_reason)
    return "tool_calls" if called and reason == "stop" else reason


class ChatShape:
    """One chat request's rendering and answer: `chat.completion` objects whose choices carry
    a `message` (streamed: `chat.completion.chunk` with a `delta`)."""

    id_prefix = "chatcmpl-"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(
        self,
        messages: list[dict[str, Any]],
        max_given: bool,
        token_ids: bool,
        thinking: tuple[str, bool] | None,
        *,
        tools: list[dict[str, Any]] | None = None,
        effort: str | None = None,
        forced: Forced | None = None,
        truncate_len: int | None = None,
        budget: tuple[str, int] | None = None,
    ) -> None:
        self.messages = messages
        self.effort = effort  # the template's `reasoning_effort` (GPT-OSS's)
        self.harmony: Harmony | None = None  # the model's channels, when it writes them
        self.thinks: Thinks | None = None  # its thinking blocks, when it writes them
        self.tools = tools  # offered: rendered by the template, calls parsed (`chat_tools`)
        self.call_form = HERMES  # how the template writes calls (`chat_tools.check_template`)
        self.forced = forced  # a required or named call (`tool_choice.py`)
        self.truncate_len = truncate_len  # the prompt's most tokens (`chat_truncate.py`)
        self.max_given = max_given  # otherwise the rest of the context after the prompt
        self.token_ids = token_ids
        self.thinking = thinking  # the field that set the template's thinking, and how
        # the field that asked for a thinking budget, and its tokens (`chat_think.think_rules`)
        self.budget = budget
        self.rendered = ""

    def prompt(
        self, req: CompletionRequest, tokenizer: Any, entry: ModelEntry
    ) -> tuple[CompletionRequest, list[int]]:
        if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
            raise bad_request(
                f"model: {entry.name} has no chat template; send its prompt to "
                "/inference/v1/completions",
                "model",
            )
        switch: dict[str, Any] = {}
        if self.thinking is not None:
            field, on = self.thinking
            switch |= template_switch(field, on, str(tokenizer.chat_template), entry.name)
        if self.tools is not None:
            self.call_form = check_template(tokenizer, entry.name)
            switch["tools"] = self.tools
        if self.effort is not None:
            if "reasoning_effort" not in str(tokenizer.chat_template):
                raise bad_request(f"reasoning_effort: not served: {REASONING}", "reasoning_effort")
            switch["reasoning_effort"] = self.effort
        self.harmony = Harmony.of(tokenizer, entry.name)
        if self.harmony is not None and req.response_format is not None:
            raise bad_request(
                f"response_format: {entry.name} replies in harmony channels, whose structural "
                "tokens a grammar cannot allow; constrained decoding is not served for it",
                "response_format",
            )

        def render(messages: list[dict[str, Any]]) -> tuple[str, list[int]]:
            try:
                text = str(
                    tokenizer.apply_chat_template(
                        messages, tokenize=False, add_generation_prompt=True, **switch
                    )
                )
            except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
                # the template ran on the caller's messages: what it raises is about them
                raise bad_request(
                    f"messages: the chat template of {entry.name} refuses them: {str(exc)[:300]}",
                    "messages",
                ) from None
            return text, [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]

        self.rendered, ids = render(self.messages)
        limit = self.truncate_len
        if limit is not None and len(ids) > limit:
            kept = fit(self.messages, lambda messages: len(render(messages)[1]), limit)
            self.rendered, ids = render(kept)
        if self.harmony is None:
            self.thinks = Thinks.of(tokenizer, self.rendered)
        held: dict[str, int] = getattr(tokenizer, "get_added_vocab", dict)()
        added = frozenset(tag for tag in TAGS if tag in held)
        mode, asked = self._thinking(), req.response_format
        if self.budget is not None:
            check_budget(self.budget[0], mode, added, entry.name, asked)
        thought = Thought(mode, added, None if self.budget is None else self.budget[1])
        if self.forced is not None and self.tools is not None:
            grammar = calls_grammar(self.forced, self.tools, self.call_form, thought)
            req = dataclasses.replace(req, response_format=grammar)
        elif asked is not None and mode != "off" and THINK_END not in asked.text:
            # the asked grammar holds the answer after the thinking (one that writes
            # `</think>` itself holds the whole reply)
            req = dataclasses.replace(req, response_format=thinking_first(asked, thought))
        elif self.budget is not None:
            req = dataclasses.replace(req, response_format=budgeted(thought, self.budget[0]))
        if not self.max_given:
            left = entry.max_seq_length - len(ids)
            if left < 1:
                raise bad_request(
                    f"messages: {len(ids)} prompt tokens fill the context length "
                    f"{entry.max_seq_length} of {entry.name}",
                    "messages",
                )
            req = dataclasses.replace(req, max_tokens=left)
        return req, ids

    def _thinking(self) -> Thinking:
        """Where a forced call's reply may think first: inside the block the rendered prompt
        left open, in a block of its own where the template thinks, else nowhere."""
        if (self.thinking is not None and not self.thinking[1]) or self.thinks is None:
            return "off"
        return "open" if self.thinks.open else "optional"

    def _logprobs(
        self, ready: Prepared, group: dict[str, Any], seq: dict[str, Any]
    ) -> dict[str, Any] | None:
        if not ready.req.logprobs:
            return None
        return {"content": logprob_rows(ready.req, ready.tokens, ready.prompt, group, seq)}

    def tail(
        self, ready: Prepared, group: dict[str, Any], seq: dict[str, Any], called: bool = False
    ) -> dict[str, Any]:
        """A choice's fields beside its message: finish reason, logprobs, raw output, ids."""
        out: dict[str, Any] = {
            "finish_reason": _finish(seq["stop_reason"], called),
            "logprobs": self._logprobs(ready, group, seq),
        }
        if ready.req.raw_output:
            fragments: list[Any] = [self.rendered]
            out["raw_output"] = raw_output(ready.req, ready.tokens, ready.prompt, fragments, seq)
        if self.token_ids:  # the ids of the message's content
            out["token_ids"] = ready.req.echoed(ready.prompt) + [int(t) for t in seq["tokens"]]
        return out

    def message(self, ready: Prepared, tokens: list[int]) -> dict[str, Any]:
        """The message a choice's `tokens` make, the echoed prompt's text first: a harmony
        reply split into `reasoning_content` and `content`; else a thinking block split off
        into `reasoning_content` (`chat_think`), then the calls of offered tools parsed out of
        the rest into `tool_calls`, the rest of it the content. The whole answer's choice and
        the last chunk of a streamed one both read it."""
        echoed = ready.tokens.text(ready.req.echoed(ready.prompt))

        def said(text: str | None) -> str | None:
            return echoed + (text or "") if echoed else text

        reply = None if self.harmony is None else self.harmony.split(tokens, ready.tokens.text)
        if reply is not None:
            content = said(reply.content)
            return {"role": "assistant", "content": content, "reasoning_content": reply.reasoning}
        text = ready.tokens.text(tokens)
        out: dict[str, Any] = {"role": "assistant"}
        if self.thinks is not None:
            reasoning, text = self.thinks.split(text)
            if reasoning is not None:
                out["reasoning_content"] = reasoning
        if self.tools is None:
            out["content"] = echoed + text
            return out
        parsed = parse_calls(text, self.call_form, self.tools)
        out["content"] = said(parsed.content)
        if parsed.calls:
            out["tool_calls"] = parsed.calls
        return out

    def choice(self, ready: Prepared, group: dict[str, Any], i: int) -> dict[str, Any]:
        seq = group["sequences"][i]
        message = self.message(ready, [int(t) for t in seq["tokens"]])
        tail = self.tail(ready, group, seq, "tool_calls" in message)
        return {"index": i, "message": message, **tail}

    def delta(self, ready: Prepared, i: int, text: str, first: bool) -> dict[str, Any]:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": i, "delta": delta, "finish_reason": None}

    def last(self, ready: Prepared, group: dict[str, Any], i: int, rest: str, first: bool) -> Any:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if rest or first:
            delta["content"] = rest
        return {"index": i, "delta": delta, **self.tail(ready, group, group["sequences"][i])}

    def stream(self, ready: Prepared, i: int) -> ChoiceStream:
        if self.harmony is not None:
            return ChannelStream(self, ready, i)
        if self.tools is not None or self.thinks is not None:
            form = None if self.tools is None else self.call_form
            return CallStream(self, ready, i, form, self.thinks)
        return TextStream(self, ready, i)

    def extra(self, ready: Prepared) -> dict[str, Any]:
        return {"prompt_token_ids": ready.prompt} if self.token_ids else {}


@router.post("/inference/v1/chat/completions", response_model=None)
@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(request: Request) -> Response:
    started = time.monotonic()
    bridge = request.app.state.tinker
    raw = await json_object(request, bridge.worker.config.max_body_bytes)
    req, shape = parse_chat(raw)
    return await serve(request, req, shape, started)
