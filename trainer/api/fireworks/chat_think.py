"""Thinking blocks on the chat route (docs/semantics.md §25a): a reply's `<think>...</think>`
(Qwen3, Qwen3.5, DeepSeek-R1 style) split off into `reasoning_content`, as the Fireworks API
answers a reasoning model, the rest being the `content`.

A template that writes `<think>` thinks. Its reply's reasoning is the text inside the block: a
block the reply opens (its text starts with `<think>`), or the one the rendered prompt left
open (the reply starts inside it). The reasoning is trimmed of newlines at both ends and the
content of newlines at its start, as the template trims them when it writes such a turn back
(`<think>\\nREASONING\\n</think>\\n\\nCONTENT`). A block not closed yet (cut by `max_tokens`) is all
reasoning; a reply that opens no block is all content.

A constrained reply (a `response_format`, a forced tool call, a thinking budget) thinks under
the grammar pieces here (`Thought`, `think_rules`): its thought first, then what is asked.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from trainer.api.fireworks.chat_tools import keeps
from trainer.contract.grammar import OutputGrammar
from trainer.serving.errors import bad_request

THINK, THINK_END = "<think>", "</think>"
# where a constrained reply may think first (`think_rules`): not at all, perhaps (a block of its
# own), or inside the block the generation prompt opened (the reply must close it)
Thinking = Literal["off", "optional", "open"]


@dataclass(frozen=True)
class Thinks:
    """How a thinking template's reply starts: `open` when the prompt left a block open."""

    open: bool

    @staticmethod
    def of(tokenizer: Any, rendered: str) -> Thinks | None:
        """None for a template that does not think, or a tokenizer that drops the tags from
        decoded text (special tokens): its replies then have no block to find."""
        if THINK not in str(tokenizer.chat_template):
            return None
        if not (keeps(tokenizer, THINK) and keeps(tokenizer, THINK_END)):
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


def lark_tag(text: str, added: frozenset[str]) -> str:
    """`text` in a Lark grammar: the token of that name when the tokenizer holds it as an added
    token (`added`; llguidance allows such a token only by name), else a string literal."""
    return text if text in added else json.dumps(text, ensure_ascii=False)


@dataclass(frozen=True)
class Thought:
    """How a constrained reply thinks: where (`thinking`), which tags the tokenizer holds as
    added tokens (`added`; llguidance allows such a token only by name), and the most tokens a
    thought may take (`budget`; None: any)."""

    thinking: Thinking
    added: frozenset[str] = frozenset()
    budget: int | None = None


def think_rules(thought: Thought) -> tuple[str, list[str]]:
    """A constrained reply's thinking, in Lark: what its `start` opens with ("" for none) and
    the rules that uses. A thought runs to the first `</think>`; where that is an added token,
    to that token, and the thought may not hold its text spelled out. A budget ends the thought
    at that many tokens, `</think>` then the only token allowed (so only where it is one)."""
    added = thought.added
    if THINK_END in added:
        regex = _without(THINK_END)
        if thought.budget is not None:
            rules = [f"think_rest: thought_text {THINK_END}"]
            rules.append(f"thought_text[max_tokens={thought.budget}]: /{regex}/")
        else:
            rules = [f"think_rest: THINK_TEXT {THINK_END}", f"THINK_TEXT: /{regex}/"]
    else:
        rules = [f'think_rest[lazy]: /(.|\\n)*/ "{THINK_END}"']
    gap = ' "\\n\\n"'  # as the template writes a turn back
    opening = {
        "off": "",
        "optional": f"({lark_tag(THINK, added)} think_rest{gap})?",
        "open": f"think_rest{gap}",
    }[thought.thinking]
    return opening, rules if opening else []


def thinking_first(grammar: OutputGrammar, thought: Thought) -> OutputGrammar:
    """`grammar` (a `response_format`) held to the reply's content, after its thinking as
    `thought` says: llguidance's grammar of several, the first the thinking then the second,
    the asked one (`@answer`)."""
    opening, rules = think_rules(thought)
    main = "\n".join([f"start: {opening} @answer", *rules])
    answer: dict[str, object] = {"name": "answer"}
    if grammar.kind == "json_schema":
        answer["json_schema"] = json.loads(grammar.text)
    elif grammar.kind == "gbnf":
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            answer["lark_grammar"] = gbnf_to_lark(grammar.text)
        except Exception as exc:  # the converter raises plain Exception on bad text
            raise bad_request(f"{grammar.field}: {str(exc)[:300]}", grammar.field) from None
    else:
        answer["lark_grammar"] = grammar.text
    composed = json.dumps({"grammars": [{"lark_grammar": main}, answer]})
    return OutputGrammar("llguidance", composed, grammar.field)


def budgeted(thought: Thought, field: str) -> OutputGrammar:
    """A reply whose thinking has a budget and whose answer is free: any text, and the tags
    the tokenizer holds as added tokens (its tool calls' too); `field` asked for the budget."""
    opening, rules = think_rules(thought)
    tags = " | ".join(sorted(t for t in thought.added if t not in (THINK, THINK_END)))
    free = f"(ANSWER_TEXT | {tags})*" if tags else "ANSWER_TEXT?"
    rules += [f"answer: {free}", "ANSWER_TEXT: /(.|\\n)+/"]
    return OutputGrammar("lark", "\n".join([f"start: {opening} answer", *rules]), field)


def _without(mark: str) -> str:
    """A regex (Lark's, `/` escaped) of the texts that do not hold `mark`, a text whose first
    character is in it only once: from each partial match, a character that neither goes on
    nor starts again leaves it, one that starts again (the first character) restarts it."""
    first, rest = re.escape(mark[0]), [re.escape(c) for c in mark[1:]]

    partial = ""  # a proper start of mark[1:], perhaps none: "(a(b)?)?"
    for c in reversed(rest[:-1]):
        partial = f"({c}{partial})?"
    leave, out = "", ""
    for k in range(len(rest), 0, -1):  # after first + rest[:k-1], a character that is not rest[k-1]
        inner = f"[^{first}{rest[k - 1]}]"
        leave = inner if not leave else f"({inner}|{rest[k - 1]}{leave})"
        out = leave
    again = f"{partial}{first}"
    regex = f"([^{first}]|{first}({again})*{out})*({first}({again})*{partial})?"
    return regex.replace("/", "\\/")
