"""How one choice of a streamed completion is sent (docs/semantics.md §25, §25a): a
`ChoiceStream` turns the tokens the choice has so far into its next chunk, and its whole
sequence into its last one. The text route and a plain chat send the decoded text
(`TextStream`); a chat whose reply has structure (tool calls, harmony channels) sends its parts
(`chat_stream.py`). Whatever a stream sends adds up to the whole answer's choice.
"""

from __future__ import annotations

from typing import Any, Protocol

from trainer.api.fireworks.completions_wire import CompletionRequest, Tokens, full_text


class Ready(Protocol):
    """What a stream reads of a completion ready to run (`completion_run.Prepared`)."""

    req: CompletionRequest
    tokens: Tokens
    prompt: list[int]


class ChoiceStream(Protocol):
    def opening(self) -> dict[str, Any] | None:
        """The choice's first chunk before any token (the echoed prompt), if it has one."""
        ...

    def step(self, made: list[int]) -> dict[str, Any] | None:
        """The chunk that `made` (all the choice's tokens so far) adds; None: nothing yet."""
        ...

    def end(self, group: dict[str, Any], seq: dict[str, Any]) -> dict[str, Any]:
        """The choice's last chunk: the rest of it, its finish reason, logprobs, raw output."""
        ...


class Chunks(Protocol):
    """A route's chunk formats (its `Shape`'s `delta` and `last`; `ready`: its `Prepared`)."""

    def delta(self, ready: Any, i: int, text: str, first: bool) -> dict[str, Any]: ...

    def last(self, ready: Any, group: dict[str, Any], i: int, rest: str, first: bool) -> Any: ...


class TextStream:
    """Choice `i` sent as its decoded text: each step sends what the text adds, once it ends on
    a whole character (a partial UTF-8 sequence decodes to U+FFFD and waits for the rest)."""

    def __init__(self, chunks: Chunks, ready: Ready, i: int) -> None:
        self.chunks, self.ready, self.i = chunks, ready, i
        self.echo = ready.tokens.text(ready.req.echoed(ready.prompt))
        self.sent, self.opened = self.echo, False

    def opening(self) -> dict[str, Any] | None:
        if not self.echo:
            return None
        self.opened = True
        return self.chunks.delta(self.ready, self.i, self.echo, True)

    def step(self, made: list[int]) -> dict[str, Any] | None:
        text = self.echo + self.ready.tokens.text(made)
        if not text.startswith(self.sent) or text.endswith("\ufffd"):
            return None
        chunk = self.chunks.delta(self.ready, self.i, text[len(self.sent) :], not self.opened)
        self.sent, self.opened = text, True
        return chunk

    def end(self, group: dict[str, Any], seq: dict[str, Any]) -> dict[str, Any]:
        whole = full_text(self.ready.req, self.ready.tokens, self.ready.prompt, seq)
        rest = whole[len(self.sent) :] if whole.startswith(self.sent) else ""
        out: dict[str, Any] = self.chunks.last(self.ready, group, self.i, rest, not self.opened)
        return out
