"""Tools on the chat route (docs/semantics.md §25a): the `tools` a request offers, rendered by
the model's own chat template, and the calls parsed back out of each completion.

One call format is parsed: Hermes-style, as Qwen2.5 and Qwen3 templates write it, each call a
JSON object `{"name": ..., "arguments": ...}` between `<tool_call>` and `</tool_call>`. A
template that writes its calls otherwise (Qwen3.5's and Qwen3-Coder's `<function=...>` XML,
Llama's bare JSON, Mistral's `[TOOL_CALLS]`) or none at all is refused when tools are offered,
so a call is never left unparsed in `content` as if it were text. Parsing follows vLLM's
`hermes` parser: the content is the text before the first call (none when that is empty), each
call's arguments are written back as JSON, and a completion whose calls do not all parse as
JSON objects with a name is all content, as if it called nothing.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from trainer.serving.errors import bad_request

START, END = "<tool_call>", "</tool_call>"
XML_CALLS = "<function="  # Qwen3.5 / Qwen3-Coder's parameter-by-parameter calls
CALLS = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
CHOICES = ("auto", "none")


@dataclass(frozen=True)
class Parsed:
    """A completion's message: its content (None: only calls) and calls (empty: none)."""

    content: str | None
    calls: list[dict[str, Any]]


def parse_tools(raw: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The request's tools to render and parse: each `{type: function, function: {name, ...}}`
    (a 400 naming the first field that is wrong); None when there are none, or `tool_choice`
    is `none` (the conversation is then rendered without them and nothing is parsed)."""
    choice = raw.get("tool_choice")
    if choice is not None and choice not in CHOICES:
        raise bad_request(
            f"tool_choice: {str(choice)[:80]!r} is not served: only 'auto' and 'none' (a "
            "required or named call needs constrained decoding)",
            "tool_choice",
        )
    tools = raw.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("tools: must be a list of {type: 'function', function: {...}}", "tools")
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_request(f"{where}.type: only 'function' tools are served", f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise bad_request(f"{where}.function: must be an object", f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            where = f"{where}.function.name"
            raise bad_request(f"{where}: a non-empty string", where)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            where = f"{where}.function.parameters"
            raise bad_request(f"{where}: a JSON Schema object", where)
    if choice == "none" or not tools:
        return None
    return tools


def check_template(tokenizer: Any, model: str) -> None:
    """A 400 naming `tools` unless the model's chat template writes Hermes-style calls and
    its tokenizer decodes their tags as text (a tag it drops as a special token would leave
    the calls unfound)."""
    text = str(tokenizer.chat_template)
    if START not in text or XML_CALLS in text:
        raise bad_request(
            f"tools: the chat template of {model} does not write tool calls as "
            "<tool_call>{JSON}</tool_call>, the one format this worker parses",
            "tools",
        )
    for tag in (START, END):
        ids = tokenizer.encode(tag, add_special_tokens=False)
        if tag not in str(tokenizer.decode(ids, skip_special_tokens=True)):
            raise bad_request(
                f"tools: the tokenizer of {model} drops {tag} from decoded text (a special "
                "token), so its tool calls cannot be parsed",
                "tools",
            )


def parse_calls(text: str) -> Parsed:
    """The message of a completion `text` that may call tools (the module docstring)."""
    start = text.find(START)
    if start < 0:
        return Parsed(text, [])
    calls: list[dict[str, Any]] = []
    for closed, open_ended in CALLS.findall(text):
        try:
            call = json.loads(closed or open_ended)
        except ValueError:
            return Parsed(text, [])
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return Parsed(text, [])
        if "arguments" not in call:
            return Parsed(text, [])
        arguments = json.dumps(call["arguments"], ensure_ascii=False)
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": call["name"], "arguments": arguments},
            }
        )
    return Parsed(text[:start] or None, calls)
