"""`response_format` on the completion routes (docs/semantics.md §17.2), in the Fireworks SDK's
shape (`ResponseFormat`): what the samples' text must match, as an `OutputGrammar`."""

from __future__ import annotations

import json
from typing import Any

from trainer.contract.grammar import OutputGrammar
from trainer.serving.errors import bad_request

FIELD = "response_format"
KEYS = {"type", "schema", "json_schema", "grammar"}
# the keys of OpenAI's wrapper around a schema (`{"name": ..., "schema": {...}}`)
WRAPPER = {"name", "schema", "strict", "description"}
ANY_OBJECT = {"type": "object"}  # `json_object` without a schema: a JSON object


def parse_response_format(value: Any) -> OutputGrammar | None:
    """None for none (absent, or `{type: text}`); a 400 naming the part that is wrong."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request(f"{FIELD}: an object with a type", FIELD)
    for key in value:
        if key not in KEYS:
            raise bad_request(f"{FIELD}.{str(key)[:40]}: not a field of it", f"{FIELD}.{key}")
    kind = value.get("type")
    given = {k for k, v in value.items() if k != "type" and v is not None}
    wanted = {"text": set(), "json_object": {"schema"}, "json_schema": {"json_schema"}}
    wanted["grammar"] = {"grammar"}
    if kind not in wanted:
        raise bad_request(
            f"{FIELD}.type: one of json_object, json_schema, grammar or text", f"{FIELD}.type"
        )
    extra = sorted(given - wanted[kind])
    if extra:
        raise bad_request(f"{FIELD}.{extra[0]}: not read with type {kind}", f"{FIELD}.{extra[0]}")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = value.get("schema")
        text = json.dumps(ANY_OBJECT if schema is None else _schema(schema, f"{FIELD}.schema"))
        return OutputGrammar("json_schema", text, FIELD)
    if kind == "json_schema":
        where = f"{FIELD}.json_schema"
        if value.get("json_schema") is None:
            raise bad_request(f"{where}: required with type json_schema", where)
        schema = _schema(value["json_schema"], where)
        if "schema" in schema and set(schema) <= WRAPPER:  # OpenAI's wrapper
            schema = _schema(schema["schema"], f"{where}.schema")
        return OutputGrammar("json_schema", json.dumps(schema), FIELD)
    grammar = value.get("grammar")
    if not isinstance(grammar, str) or not grammar.strip():
        where = f"{FIELD}.grammar"
        raise bad_request(f"{where}: a GBNF grammar (a non-empty string)", where)
    return OutputGrammar("gbnf", grammar, FIELD)


def _schema(value: Any, where: str) -> dict[str, Any]:
    """A JSON Schema given as an object or as its JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise bad_request(f"{where}: not JSON", where) from None
    if not isinstance(value, dict):
        raise bad_request(f"{where}: a JSON Schema (an object)", where)
    return value
