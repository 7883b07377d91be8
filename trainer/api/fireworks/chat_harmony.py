"""Replies in channels (OpenAI's harmony format, GPT-OSS) on the chat route (docs/semantics.md
§25a): the reasoning and the answer split into `reasoning_content` and `content`.

A harmony model writes each message as `<|channel|>NAME<|message|>TEXT` ended by `<|end|>`,
`<|return|>` or `<|call|>`, the next one opening with `<|start|>ROLE`; decoded with its special
tokens skipped, a reply would run the channels' names and texts together. The completion is
split at those tokens instead, by id: `analysis` messages are the reasoning, every other
channel's (`final`, `commentary`) the content, each side's messages joined by a newline, and a
message cut short by `max_tokens` counts for its channel (one cut inside its header, whose
channel is not known, counts for none). A completion that does not open with
a channel, or has text between its messages, is not a harmony reply and stays all content.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainer.serving.errors import bad_request

CHANNEL, MESSAGE, START = "<|channel|>", "<|message|>", "<|start|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
REASONING = "analysis"


@dataclass(frozen=True)
class Reply:
    reasoning: str | None
    content: str | None


@dataclass(frozen=True)
class Harmony:
    """The ids of a harmony tokenizer's structural tokens."""

    channel: int
    message: int
    start: int
    ends: frozenset[int]

    @staticmethod
    def of(tokenizer: Any, model: str) -> Harmony | None:
        """The model's harmony tokens when its chat template writes channels (None when it
        does not); a 400 naming `model` when its tokenizer lacks one as a single token."""
        if CHANNEL not in str(getattr(tokenizer, "chat_template", "") or ""):
            return None
        found: dict[str, int] = {}
        for mark in (CHANNEL, MESSAGE, START, *ENDS):
            ids = tokenizer.encode(mark, add_special_tokens=False)
            if len(ids) != 1:
                raise bad_request(
                    f"model: the chat template of {model} writes harmony channels, and its "
                    f"tokenizer has no single token {mark}, so its replies cannot be split",
                    "model",
                )
            found[mark] = int(ids[0])
        ends = frozenset(found[mark] for mark in ENDS)
        return Harmony(found[CHANNEL], found[MESSAGE], found[START], ends)

    def split(self, tokens: list[int], text: Callable[[list[int]], str]) -> Reply | None:
        """A completion's `tokens` as reasoning and content (`text`: ids to text, special
        tokens skipped); None when they do not open with a channel."""
        if not tokens or tokens[0] != self.channel:
            return None
        reasoning: list[str] = []
        content: list[str] = []
        i, n = 0, len(tokens)
        while i < n:
            if tokens[i] == self.start:  # the next message's role, up to its channel
                while i < n and tokens[i] != self.channel:
                    i += 1
                continue
            if tokens[i] != self.channel:  # between messages: only what decodes to nothing
                if text([tokens[i]]):
                    return None
                i += 1
                continue
            header = i + 1
            while i < n and tokens[i] != self.message:
                i += 1
            if i == n:  # a header still coming: its channel is not known yet
                break
            name = text(tokens[header:i]).split()
            body = i + 1
            while i < n and tokens[i] not in self.ends and tokens[i] != self.start:
                i += 1
            words = text(tokens[body:i])
            (reasoning if name[:1] == [REASONING] else content).append(words)
            if i < n and tokens[i] in self.ends:
                i += 1
        return Reply("\n".join(reasoning) if reasoning else None, "\n".join(content) or None)
