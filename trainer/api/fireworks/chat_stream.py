"""A chat choice streamed in parts (docs/semantics.md §25a): a reply in harmony channels sends
`reasoning_content` and `content` deltas as each grows (`ChannelStream`); a reply that may think
or call tools sends its reasoning as it grows and its content up to where a call may begin
(each less what may still grow into a tag), then holds the rest until the end, whose chunk
carries the calls (`CallStream`). What either sends adds up to the whole answer's message,
which `ChatShape.message` makes from the same tokens for both.
"""

from __future__ import annotations

from typing import Any, Protocol

from trainer.api.fireworks.chat_think import Thinks, partial
from trainer.api.fireworks.chat_tools import START, XML, XML_CALLS
from trainer.api.fireworks.completion_stream import Ready


class ChatShape(Protocol):
    """What a part stream reads of its `chat.ChatShape`: the message tokens make, and a
    choice's fields beside it."""

    def message(self, ready: Any, tokens: list[int]) -> dict[str, Any]: ...

    def tail(
        self, ready: Any, group: dict[str, Any], seq: dict[str, Any], called: bool = False
    ) -> dict[str, Any]: ...


class _Parts:
    """Choice `i`'s message parts sent so far, and its chunks."""

    def __init__(self, shape: ChatShape, ready: Ready, i: int) -> None:
        self.shape, self.ready, self.i = shape, ready, i
        self.echo = ready.tokens.text(ready.req.echoed(ready.prompt))
        self.sent: dict[str, str] = {"reasoning_content": "", "content": self.echo}
        self.opened = False

    def opening(self) -> dict[str, Any] | None:
        if not self.echo:
            return None
        self.opened = True
        delta = {"role": "assistant", "content": self.echo}
        return {"index": self.i, "delta": delta, "finish_reason": None}

    def _delta(self, parts: dict[str, str], last: bool) -> dict[str, Any]:
        """What `parts` add to what was sent (a part that no longer extends it adds nothing;
        before the last chunk, nor one that ends inside a character)."""
        delta: dict[str, Any] = {} if self.opened else {"role": "assistant"}
        for key, value in parts.items():
            before = self.sent[key]
            grows = len(value) > len(before) and value.startswith(before)
            if grows and (last or not value.endswith("\ufffd")):
                delta[key] = value[len(before) :]
                self.sent[key] = value
        return delta

    def _chunk(self, delta: dict[str, Any]) -> dict[str, Any] | None:
        if not delta:
            return None
        self.opened = True
        return {"index": self.i, "delta": delta, "finish_reason": None}


class ChannelStream(_Parts):
    """A harmony reply: its reasoning and content as the message of the tokens so far has
    them (a reply not in channels: all content, as the whole answer has it)."""

    def _parts(self, tokens: list[int]) -> dict[str, str]:
        message = self.shape.message(self.ready, tokens)
        return {key: message.get(key) or "" for key in ("reasoning_content", "content")}

    def step(self, made: list[int]) -> dict[str, Any] | None:
        return self._chunk(self._delta(self._parts(made), last=False))

    def end(self, group: dict[str, Any], seq: dict[str, Any]) -> dict[str, Any]:
        delta = self._delta(self._parts([int(t) for t in seq["tokens"]]), last=True)
        return {"index": self.i, "delta": delta, **self.shape.tail(self.ready, group, seq)}


class CallStream(_Parts):
    """A reply that may think (`thinks`) or call tools (`form`, None: no tools): its
    reasoning is sent as it grows, its content up to where a call may begin (the first call
    tag, less any end of the text that could still grow into one); the last chunk has the rest
    of the content and the calls, numbered by `index`, as the whole answer reads them."""

    def __init__(
        self, shape: ChatShape, ready: Ready, i: int, form: str | None, thinks: Thinks | None
    ) -> None:
        super().__init__(shape, ready, i)
        self.thinks = thinks
        self.marks: tuple[str, ...] = ()
        if form is not None:
            self.marks = (START, XML_CALLS) if form == XML else (START,)

    def _visible(self, text: str) -> str:
        cut = min((text.find(m) for m in self.marks if m in text), default=len(text))
        text = text[:cut]
        held = max((partial(text, mark) for mark in self.marks), default=0)
        return text[: len(text) - held]

    def step(self, made: list[int]) -> dict[str, Any] | None:
        text = self.ready.tokens.text(made)
        reasoning, rest = (None, text) if self.thinks is None else self.thinks.split(text, False)
        parts = {"content": self.echo + self._visible(rest)}
        if self.thinks is not None:
            parts = {"reasoning_content": reasoning or "", **parts}
        return self._chunk(self._delta(parts, last=False))

    def end(self, group: dict[str, Any], seq: dict[str, Any]) -> dict[str, Any]:
        message = self.shape.message(self.ready, [int(t) for t in seq["tokens"]])
        parts = {key: message.get(key) or "" for key in ("reasoning_content", "content")}
        delta = self._delta(parts, last=True)
        calls = message.get("tool_calls", [])
        if calls:
            delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls)]
        tail = self.shape.tail(self.ready, group, seq, bool(calls))
        return {"index": self.i, "delta": delta, **tail}
