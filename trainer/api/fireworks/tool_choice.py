"""`tool_choice` `required` or a named function on the chat route (docs/semantics.md §25a): the
reply is held, by constrained decoding (§17.2), to calls written as the model's own template
writes them, which `chat_tools.parse_calls` then reads back as for `auto`.

The grammar (llguidance's Lark) is a reply of calls and nothing else, but for a thinking
block where the template lets the model think:
- *Hermes*: each call `<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>`, ARGS the
  tool's `parameters` JSON Schema, written with `", "` and `": "` and no other whitespace (as
  the template's `tojson` writes them);
- *XML*: each call `<tool_call>\\n<function=NAME>\\n`, then
  `<parameter=KEY>\\nVALUE\\n</parameter>\\n` for each property of the schema, in its order
  (the `required` ones always, the others perhaps), then `</function>\\n</tool_call>`. A VALUE
  whose schema type is integer, number, object or array is JSON of that schema; a boolean
  `True` or `False` (Python's, as the template's `string` writes it); a string enum one of its
  values; anything else text (up to the closing tag). A schema without properties takes any
  keys, as text.
Calls follow one another after a newline: one or more of any offered tool for `required`,
exactly one of the named tool for a named choice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from trainer.api.fireworks.chat_think import THINK, THINK_END, Thought, lark_tag, think_rules
from trainer.api.fireworks.chat_tools import END as CALL_END
from trainer.api.fireworks.chat_tools import START as CALL
from trainer.api.fireworks.chat_tools import XML
from trainer.contract.grammar import OutputGrammar
from trainer.serving.errors import bad_request

FIELD = "tool_choice"
TAGS = (CALL, CALL_END, THINK, THINK_END)  # what a tokenizer may hold as added tokens
# the template's `tojson`: json.dumps' separators, no other whitespace
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# XML values the template writes as JSON (`tojson` for objects and arrays; a number's `string`
# is its JSON); a boolean's `string` is Python's, True or False
JSON_TYPES = ("integer", "number", "object", "array")
ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class Forced:
    """A reply that must call: `name` None for one or more calls of any offered tool, else
    exactly one call of that tool."""

    name: str | None


def parse_choice(choice: Any) -> Forced | None:
    """`tool_choice`: None for `auto` (or absent) and `none`; a 400 naming the part that is
    wrong. Whether the named tool is offered is checked with the tools (`check_forced`)."""
    if choice is None or choice in ("auto", "none"):
        return None
    if choice == "required":
        return Forced(None)
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise bad_request(f"{FIELD}.type: only 'function' is served", f"{FIELD}.type")
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            where = f"{FIELD}.function.name"
            raise bad_request(f"{where}: the name of an offered tool", where)
        return Forced(name)
    raise bad_request(
        f"{FIELD}: {str(choice)[:80]!r} is not one of 'auto', 'none', 'required' or "
        "{'type': 'function', 'function': {'name': ...}}",
        FIELD,
    )


def check_forced(forced: Forced, tools: list[dict[str, Any]] | None) -> None:
    """A forced call needs tools, and a named one a tool of that name (400s naming
    `tool_choice`); each tool's `parameters` must compile (a 400 naming it)."""
    if not tools:
        raise bad_request(f"{FIELD}: a required or named call needs tools", FIELD)
    names = [tool["function"]["name"] for tool in tools]
    if forced.name is not None and forced.name not in names:
        where = f"{FIELD}.function.name"
        raise bad_request(f"{where}: {forced.name[:80]!r} is not an offered tool", where)
    for i, tool in enumerate(tools):
        error = lark_error(f"start: %json {json.dumps(_arguments(tool))}")
        if error:
            where = f"tools[{i}].function.parameters"
            raise bad_request(f"{where}: its JSON Schema does not compile: {error[:300]}", where)


def calls_grammar(
    forced: Forced, tools: list[dict[str, Any]], form: str, thought: Thought
) -> OutputGrammar:
    """The reply's grammar: calls in the template's `form`, after thinking as `thought` says.
    A tag (`TAGS`) the tokenizer holds as an added token is allowed only as that token (by
    name, `<tool_call>`), as the model writes it, never spelled out in pieces."""

    def tag(text: str) -> str:
        return lark_tag(text, thought.added)

    chosen = [t for t in tools if forced.name in (None, t["function"]["name"])]
    functions = " | ".join(f"fn_{i}" for i in range(len(chosen)))
    rules = [
        *(_xml(i, tool) if form == XML else _hermes(i, tool) for i, tool in enumerate(chosen)),
        f'call: {tag(CALL)} "\\n" ({functions}) "\\n" {tag(CALL_END)}',
        "calls: call" + (' ("\\n" call)*' if forced.name is None else ""),
    ]
    opening, thinking = think_rules(thought)
    start = f"start: {opening} calls"
    return OutputGrammar("lark", "\n".join([start, *rules, *thinking]), FIELD)


def lark_error(text: str) -> str:
    """Why the Lark grammar `text` does not compile ("" when it does), read without a
    tokenizer, so that a tool's schema is refused by its own name before any model runs."""
    import llguidance

    grammar = llguidance.LLMatcher.grammar_from_lark(text)
    return str(llguidance.LLMatcher.validate_grammar(grammar)).strip()


def _arguments(tool: dict[str, Any]) -> dict[str, Any]:
    """The tool's `parameters` (any object when it has none), written as `tojson` writes."""
    parameters = tool["function"].get("parameters") or ANY_OBJECT
    return {**parameters, "x-guidance": JSON_OPTIONS}


def _text(value: str) -> str:
    """`value` as a Lark string literal."""
    return lark_tag(value, frozenset())


def _hermes(i: int, tool: dict[str, Any]) -> str:
    name = json.dumps(tool["function"]["name"], ensure_ascii=False)
    head = _text('{"name": ' + name + ', "arguments": ')
    return f'fn_{i}: {head} %json {json.dumps(_arguments(tool))} "}}"'


def _xml(i: int, tool: dict[str, Any]) -> str:
    schema = tool["function"].get("parameters") or ANY_OBJECT
    properties = schema.get("properties")
    head = _text(f"<function={tool['function']['name']}>\n")
    value_end = '"\\n</parameter>\\n"'
    rules = [f"fn_{i}_text[lazy]: /(.|\\n)*/ {value_end}"]
    if not isinstance(properties, dict) or not properties:
        rules.append(f'fn_{i}_any: "<parameter=" /[^>\\n]+/ ">\\n" fn_{i}_text')
        return "\n".join([*rules, f'fn_{i}: {head} fn_{i}_any* "</function>"'])
    required = set(schema.get("required") or ())
    parts = []
    for k, (key, sub) in enumerate(properties.items()):
        rule = f"fn_{i}_{k}"
        open_tag = _text(f"<parameter={key}>\n")
        rules.append(f"{rule}: {open_tag} {_xml_value(i, sub, schema, value_end)}")
        parts.append(rule if key in required else f"{rule}?")
    return "\n".join([*rules, f'fn_{i}: {head} {" ".join(parts)} "</function>"'])


def _xml_value(i: int, sub: Any, schema: dict[str, Any], value_end: str) -> str:
    """One XML parameter's value and closing tag, as its schema `sub` types it."""
    if not isinstance(sub, dict):
        return f"fn_{i}_text"
    enum = sub.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return "(" + " | ".join(_text(v) for v in enum) + f") {value_end}"
    if sub.get("type") == "boolean":
        return f'("True" | "False") {value_end}'
    if sub.get("type") in JSON_TYPES:
        # the root's definitions go along, so that a `$ref` into them still resolves
        shared = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
        typed = {**shared, **sub, "x-guidance": JSON_OPTIONS}
        return f"%json {json.dumps(typed)} {value_end}"
    return f"fn_{i}_text"
