"""The chat fields that set a reply's thinking (docs/semantics.md §25a): `reasoning_effort` and
`thinking` turn it on or off through the template's own switch, give a harmony template its
effort, or cap the thought at a token budget (drawn under a grammar: `chat_think.think_rules`).
"""

from __future__ import annotations

from typing import Any

from trainer.api.fireworks.chat_think import THINK, THINK_END, Thinking
from trainer.contract.grammar import OutputGrammar
from trainer.serving.errors import bad_request

REASONING = (
    "only 'none' or false (thinking {'type': 'disabled'}) on a model whose chat template has an "
    "enable_thinking switch, true (thinking {'type': 'enabled'}) on one that thinks, and 'low', "
    "'medium' or 'high' on one whose template reads reasoning_effort (GPT-OSS), and a token "
    "budget (an integer; thinking's budget_tokens) on one whose thinking ends at a </think> "
    "token, are served"
)
EFFORTS = ("low", "medium", "high")
SWITCH = "enable_thinking"  # the template variable of Qwen3-style thinking switches
FIELDS = ("reasoning_effort", "thinking")  # the two ways to turn thinking on or off


def thinking_asked(name: str, value: Any) -> bool | None:
    """Whether `reasoning_effort` (true, or a token budget; `'none'` or false) or `thinking`
    (`{type: enabled}`, perhaps with `budget_tokens`; `{type: disabled}`) asks for thinking
    on (True) or off (False); None: neither."""
    if name == "reasoning_effort":
        if isinstance(value, bool):
            return value
        if isinstance(value, int):
            return True
        return False if isinstance(value, str) and value == "none" else None
    if name == "thinking" and isinstance(value, dict):
        if value == {"type": "disabled"}:
            return False
        if value.get("type") == "enabled" and set(value) <= {"type", "budget_tokens"}:
            return True
    return None


def thinking_budget(raw: dict[str, Any]) -> tuple[str, int] | None:
    """The field that asked for a thinking budget and the most tokens the reply may think:
    `reasoning_effort` an integer (at least 1) or `thinking.budget_tokens` (at least 1,024, as
    the Fireworks SDK documents); a 400 naming the field otherwise."""
    effort = raw.get("reasoning_effort")
    if isinstance(effort, int) and not isinstance(effort, bool):
        if effort < 1:
            raise bad_request("reasoning_effort: a token budget is at least 1", "reasoning_effort")
        return "reasoning_effort", effort
    thinking = raw.get("thinking")
    budget = thinking.get("budget_tokens") if isinstance(thinking, dict) else None
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1024:
        where = "thinking.budget_tokens"
        raise bad_request(f"{where}: an integer of at least 1024", where)
    return "thinking", budget


def template_switch(field: str, on: bool, template: str, model: str) -> dict[str, Any]:
    """The template's variables that turn thinking on or off, as `field` asks: its
    `enable_thinking` switch; on, also a harmony template's `reasoning_effort` (`medium`, as
    the Fireworks API reads `true`) or nothing where the template thinks by default."""
    if SWITCH in template:
        return {SWITCH: on}
    if on and "reasoning_effort" in template:
        return {"reasoning_effort": "medium"}
    if on and THINK in template:
        return {}
    how = "turned on: it writes no thinking" if on else "turned off"
    raise bad_request(
        f"{field}: the chat template of {model} has no {SWITCH} switch, so thinking cannot "
        f"be {how}",
        field,
    )


def check_budget(
    field: str, mode: Thinking, added: frozenset[str], model: str, asked: OutputGrammar | None
) -> None:
    """A thinking budget needs a template that thinks, a `</think>` the tokenizer holds as
    one token (a grammar can end a thought at a token, not in the middle of a text), and
    a `response_format` that leaves the thinking to it: 400s naming the field."""
    if mode == "off" or THINK_END not in added:
        raise bad_request(
            f"{field}: a thinking budget is served on a model whose template thinks in "
            f"<think> blocks ended by a </think> token, which {model} does not",
            field,
        )
    if asked is not None and THINK_END in asked.text:
        raise bad_request(
            f"{field}: a response_format that writes </think> holds the thinking itself; "
            "send it or a thinking budget",
            field,
        )
