"""OpenAPI descriptions of the bodies that routes read as raw JSON.

The operation and PATCH routes parse their body themselves (idempotency hashing, payload merge,
errors naming the field), so FastAPI cannot see their models. `json_body` puts each pydantic
model's JSON schema into the operation's `requestBody`, self-contained (no `$ref`), so the
served schema describes what the worker really accepts and a schema-driven fuzzer (the
schemathesis test) generates meaningful bodies.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    """Replace every `{"$ref": "#/$defs/X"}` by the definition (the specs are not recursive)."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            target = _inline(defs[ref.removeprefix("#/$defs/")], defs)
            extra = {k: _inline(v, defs) for k, v in node.items() if k != "$ref"}
            return {**target, **extra}
        return {k: _inline(v, defs) for k, v in node.items() if k != "$defs"}
    if isinstance(node, list):
        return [_inline(item, defs) for item in node]
    return node


def inline_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The model's validation JSON schema with its `$defs` inlined."""
    schema = model.model_json_schema(mode="validation")
    inlined: dict[str, Any] = _inline(schema, schema.get("$defs", {}))
    return inlined


def json_body(model: type[BaseModel], *, required: bool = True) -> dict[str, Any]:
    """`openapi_extra` for a route that reads `model` from a raw JSON body."""
    return {
        "requestBody": {
            "required": required,
            "content": {"application/json": {"schema": inline_schema(model)}},
        }
    }
