"""Tools on the chat route (docs/semantics.md §25a): the `tools` a request offers, rendered by
the model's own chat template, and the calls parsed back out of each completion.

Two call formats are parsed, told apart by what the template writes:
- *Hermes* (Qwen2.5, Qwen3): each call a JSON object `{"name": ..., "arguments": ...}` between
  `<tool_call>` and `</tool_call>`, read as vLLM's `hermes` parser reads it: a completion whose
  calls do not all parse as JSON objects with a name and arguments is all content, as if it
  called nothing;
- *XML* (Qwen3.5, Qwen3-Coder): `<tool_call><function=NAME><parameter=KEY>VALUE</parameter>
  ...</function></tool_call>`, read as vLLM's `qwen3_coder` parser reads it: one newline
  trimmed from each end of a value, which is then typed by the tool's JSON Schema (`null` is
  null; integer, number and boolean types convert when they can; object and array types parse
  as JSON, else as a Python literal; anything else, or a key the schema lacks, stays text).
Either way the content is the text before the first call (none when that is empty), and each
call's arguments are written as JSON. A template that writes its calls otherwise (Llama's bare
JSON, Mistral's `[TOOL_CALLS]`, harmony's channels) or none at all is refused when tools are
offered, so a call is never left unparsed in `content` as if it were text.
"""

from __future__ import annotations

import ast
import json
import math
import re
import uuid
from dataclasses import dataclass
from typing import Any

from trainer.serving.errors import bad_request

START, END = "<tool_call>", "</tool_call>"
XML_CALLS = "<function="  # Qwen3.5 / Qwen3-Coder's parameter-by-parameter calls
CALLS = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
FUNCTIONS = re.compile(r"<function=(.*?)</function>|<function=(.*)$", re.DOTALL)
PARAMETERS = re.compile(
    r"<parameter=(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", re.DOTALL
)
HERMES, XML = "hermes", "xml"
TEXT_TYPES = ("string", "str", "text", "varchar", "char", "enum")


@dataclass(frozen=True)
class Parsed:
    """A completion's message: its content (None: only calls) and calls (empty: none)."""

    content: str | None
    calls: list[dict[str, Any]]


def parse_tools(raw: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The request's tools to render and parse: each `{type: function, function: {name, ...}}`
    (a 400 naming the first field that is wrong); None when there are none, or `tool_choice`
    is `none` (the conversation is then rendered without them and nothing is parsed).
    `tool_choice` itself is read by `tool_choice.parse_choice`."""
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
    if raw.get("tool_choice") == "none" or not tools:
        return None
    return tools


def check_template(tokenizer: Any, model: str) -> str:
    """The call format the model's chat template writes (`HERMES` or `XML`); a 400 naming
    `tools` when it writes neither, or its tokenizer drops the tags from decoded text (a tag
    it drops as a special token would leave the calls unfound)."""
    text = str(tokenizer.chat_template)
    if START not in text:
        raise bad_request(
            f"tools: the chat template of {model} does not write tool calls between "
            "<tool_call> tags, as the formats this worker parses do",
            "tools",
        )
    for tag in (START, END):
        if not keeps(tokenizer, tag):
            raise bad_request(
                f"tools: the tokenizer of {model} drops {tag} from decoded text (a special "
                "token), so its tool calls cannot be parsed",
                "tools",
            )
    return XML if XML_CALLS in text else HERMES


def keeps(tokenizer: Any, tag: str) -> bool:
    """Whether `tokenizer` keeps `tag` in decoded text (it drops a special token's)."""
    ids = tokenizer.encode(tag, add_special_tokens=False)
    return tag in str(tokenizer.decode(ids, skip_special_tokens=True))


def parse_calls(text: str, form: str = HERMES, tools: list[dict[str, Any]] | None = None) -> Parsed:
    """The message of a completion `text` whose calls are written in `form` (the module
    docstring); `tools` type the XML form's values."""
    if form == XML:
        return _xml_calls(text, tools or [])
    start = text.find(START)
    if start < 0:
        return Parsed(text, [])
    calls: list[dict[str, Any]] = []
    for closed, open_ended in CALLS.findall(text):
        try:
            call = json.loads(closed or open_ended, parse_constant=_no_constant)
        except ValueError:
            return Parsed(text, [])
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return Parsed(text, [])
        if "arguments" not in call:
            return Parsed(text, [])
        calls.append(_call(call["name"], call["arguments"]))
    return Parsed(text[:start] or None, calls)


def _no_constant(name: str) -> Any:
    """`NaN` and the infinities, which JSON does not have: the call does not parse."""
    raise ValueError(f"{name} is not JSON")


def _call(name: str, arguments: Any) -> dict[str, Any]:
    arguments_json = json.dumps(arguments, ensure_ascii=False)
    function = {"name": name, "arguments": arguments_json}
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": function}


def _xml_calls(text: str, tools: list[dict[str, Any]]) -> Parsed:
    if XML_CALLS not in text:
        return Parsed(text, [])
    blocks = [closed or open_ended for closed, open_ended in CALLS.findall(text)] or [text]
    functions = [f or g for block in blocks for f, g in FUNCTIONS.findall(block)]
    calls = []
    for function in functions:
        if ">" not in function:
            continue
        name, _, body = function.partition(">")
        schema = _properties(tools, name)
        arguments = {}
        for found in PARAMETERS.findall(body):
            key, _, value = found.partition(">")
            value = value.removeprefix("\n").removesuffix("\n")
            arguments[key] = _typed(value, schema.get(key))
        calls.append(_call(name, arguments))
    if not calls:
        return Parsed(text, [])
    start = text.find(START)
    start = start if start >= 0 else text.find(XML_CALLS)
    return Parsed(text[:start] or None, calls)


def _properties(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """The JSON Schema properties of the offered tool `name` ({} when none is offered)."""
    for tool in tools:
        function = tool.get("function") or {}
        if function.get("name") == name:
            properties = (function.get("parameters") or {}).get("properties")
            return properties if isinstance(properties, dict) else {}
    return {}


def _typed(value: str, schema: Any) -> Any:
    """An XML parameter's text as its schema's type says, where it converts."""
    if value.lower() == "null":
        return None
    kind = str(schema.get("type", "string") if isinstance(schema, dict) else "string")
    kind = kind.strip().lower()
    if schema is None or kind in TEXT_TYPES:
        return value
    try:
        if kind.startswith(("int", "uint", "long", "short", "unsigned")):
            return int(value)
        if kind.startswith(("num", "float")):
            number = float(value)
            if not math.isfinite(number):  # JSON has no infinity
                return value
            return int(number) if number.is_integer() else number
    except ValueError:
        return value
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        try:
            return json.loads(value)
        except ValueError:
            pass
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value
