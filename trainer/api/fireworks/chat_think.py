"""Thinking blocks on the chat route (docs/semantics.md §25a): a reply's `<think>...</think>`
(Qwen3, Qwen3.5, DeepSeek-R1 style) split off into `reasoning_content`, as the Fireworks API
answers a reasoning model, the rest being the `content`.

A template that writes `<think>` thinks. Its reply's reasoning is the text inside the block: a
block the reply opens (its text starts with `<think>`), or the one the rendered prompt left
open (the reply starts inside it). The reasoning is trimmed of newlines at both ends and the
content of newlines at its start, as the template trims them when it writes such a turn back
(`<think>\\nREASONING\\n</think>\\n\\nCONTENT`). A block not closed yet (cut by `max_tokens`) is all
reasoning; a reply that opens no block is all content.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class Thinks:
    """How a thinking template's reply starts: `open` when the prompt left a block open."""

    open: bool

    @staticmethod
    def of(template: str, rendered: str) -> Thinks | None:
        """None for a template that does not think."""
        if THINK not in template:
            return None
        return Thinks(open=rendered.rfind(THINK) > rendered.rfind(THINK_END))

    def split(self, text: str, last: bool = True) -> tuple[str | None, str]:
        """`text` (the reply so far) as (reasoning, the rest); None: no reasoning. Before the
        `last` text, what may still grow into a tag is held back: a start that may become
        `<think>`, an end of the reasoning that may become `</think>`."""
        body = text
        if not self.open:
            if not text.startswith(THINK):
                if not last and text and THINK.startswith(text):
                    return None, ""
                return None, text
            body = text[len(THINK) :]
        end = body.find(THINK_END)
        if end < 0:
            if not last:
                body = body[: len(body) - partial(body, THINK_END)]
            return body.strip("\n") or None, ""
        rest = body[end + len(THINK_END) :].lstrip("\n")
        return body[:end].strip("\n") or None, rest


def partial(text: str, mark: str) -> int:
    """The length of the longest end of `text` that is a start of `mark` (shorter than it)."""
    for n in range(min(len(mark) - 1, len(text)), 0, -1):
        if text.endswith(mark[:n]):
            return n
    return 0
