"""JSON request bodies decoded within bounds counted as the bytes are read.

A recursive descent over the bytes: containers, keys and scalars one at a time, numeric
arrays in one C-speed match each (counted by their commas, then decoded). Every bound of
`Bounds` is checked before the values it counts are allocated, and the first refusal is a
400 naming the field. The values come out as `json.loads` reads them; with a `Packer`, the
bulk numeric arrays of an operation body (`PACKED_PATHS`) go to its file as int64/float64.
Design notes: `docs/design/serving.md`.
"""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

from trainer.contract.losses import MAX_TARGET_COLUMNS, SOFT_INPUTS
from trainer.contract.specs import chunk_datums
from trainer.serving.jsonparse import (
    ANY,
    INT64_MAX,
    INT64_MIN,
    MAX_DEPTH,
    PACKED_PATHS,
    BodyError,
    Bounds,
    Packer,
    Pattern,
    check_ints,
    field_error,
    format_path,
    matches,
    out_of_range,
    pack,
    too_deep,
)

_WS = re.compile(rb"[ \t\n\r]*+")
_STRING = re.compile(rb'"(?:[^"\\\x00-\x1f]++|\\.)*+"', re.DOTALL)
_NUMBER = rb"-?+(?:0|[1-9][0-9]*+)(?:\.[0-9]++)?+(?:[eE][+-]?+[0-9]++)?+"
_SCALAR = re.compile(_NUMBER + rb"|true|false|null|NaN|Infinity|-Infinity")
_NUM_ARRAY = re.compile(
    rb"\[[ \t\n\r]*+(?:" + _NUMBER + rb"(?:[ \t\n\r]*+,[ \t\n\r]*+" + _NUMBER + rb")*+)?+"
    rb"[ \t\n\r]*+\]"
)
_LONG_DIGITS = re.compile(rb"[0-9]{19}")
_LITERALS: dict[bytes, Any] = {
    b"true": True,
    b"false": False,
    b"null": None,
    b"NaN": float("nan"),
    b"Infinity": float("inf"),
    b"-Infinity": float("-inf"),
}

# what the bounds count, by path (`ANY`: any key or index)
_BATCHES: tuple[Pattern, ...] = (
    ("samples",),
    ("gradients",),
    ("model_inputs",),
)
_DATUMS: tuple[Pattern, ...] = (  # the Tinker face's chunks (`specs.chunk_datums`)
    ("forward_backward_input", "data"),
    ("forward_input", "data"),
)
# token arrays: (pattern, length of the prefix naming the sample's model input)
_TOKENS: tuple[tuple[Pattern, int], ...] = (
    (("samples", ANY, "model_input", "chunks", ANY, "encoded_text", "tokens"), 3),
    (("model_inputs", ANY, "chunks", ANY, "encoded_text", "tokens"), 2),
    (("forward_backward_input", "data", ANY, "model_input", "chunks", ANY, "tokens"), 4),
    (("forward_input", "data", ANY, "model_input", "chunks", ANY, "tokens"), 4),
    (("prompt", "chunks", ANY, "tokens"), 1),
)
_PER_TOKEN: tuple[Pattern, ...] = (
    ("samples", ANY, "model_input", "chunks"),
    ("model_inputs", ANY, "chunks"),
    ("forward_backward_input", "data", ANY, "model_input", "chunks"),
    ("forward_input", "data", ANY, "model_input", "chunks"),
    ("prompt", "chunks"),
    ("samples", ANY, "loss_fn_inputs", ANY, "data"),
    ("gradients", ANY, "data"),
    ("forward_backward_input", "data", ANY, "loss_fn_inputs", ANY, "data"),
    ("forward_input", "data", ANY, "loss_fn_inputs", ANY, "data"),
)
# the inputs that may be [T, K] soft targets (flat data): up to MAX_TARGET_COLUMNS per token;
# the rulebook checks each one's exact length once its shape is known
_PER_TARGET: tuple[Pattern, ...] = tuple(
    (*prefix, "loss_fn_inputs", name, "data")
    for prefix in (
        ("samples", ANY),
        ("forward_backward_input", "data", ANY),
        ("forward_input", "data", ANY),
    )
    for name in SOFT_INPUTS
)
_INPUTS: tuple[Pattern, ...] = (
    ("samples", ANY, "loss_fn_inputs"),
    ("forward_backward_input", "data", ANY, "loss_fn_inputs"),
    ("forward_input", "data", ANY, "loss_fn_inputs"),
)


def _syntax(raw: bytes, message: str, pos: int) -> BodyError:
    """A syntax error worded as `json.JSONDecodeError` words it."""
    line = raw.count(b"\n", 0, pos) + 1
    column = pos - raw.rfind(b"\n", 0, pos)
    return BodyError("invalid_json", f"{message}: line {line} column {column} (char {pos})", "body")


def _numbers(text: bytes) -> list[Any]:
    if not _LONG_DIGITS.search(text):
        try:
            value: list[Any] = orjson.loads(text)
            return value
        except orjson.JSONDecodeError:
            pass  # 1e400: the standard library reads it as inf
    return list(json.loads(text, parse_int=_parse_int))


def _parse_int(text: str) -> int | str:
    return int(text) if len(text) <= 20 else text  # a str: refused with its path


class Scanner:
    """One body's decode: its position, the path being read, and what the bounds counted."""

    def __init__(self, raw: bytes, bounds: Bounds, packer: Packer | None) -> None:
        self.raw = raw
        self.bounds = bounds
        self.packer = packer
        self.pos = 0
        self.parts: list[Any] = []
        self.items = 0
        self.tokens: dict[str, int] = {}  # per sample's model input, and per call ("")

    def run(self) -> Any:
        self.pos = _WS.match(self.raw, 0).end()  # type: ignore[union-attr]
        value = self._value(1)
        end = _WS.match(self.raw, self.pos).end()  # type: ignore[union-attr]
        if end != len(self.raw):
            raise _syntax(self.raw, "Extra data", end)
        return value

    # -- bounds ----------------------------------------------------------------------------

    def _count(self, n: int = 1) -> None:
        self.items += n
        if self.items > self.bounds.max_items:
            where = format_path(self.parts) or "body"
            raise field_error(
                where,
                f"the body holds more than {self.bounds.max_items} JSON values outside numeric "
                "arrays; split the call",
            )

    def _cap(self) -> tuple[int, str] | None:
        """How many elements the array at the current path may hold, and what the cap is."""
        b = self.bounds
        if matches(self.parts, _BATCHES):
            return b.max_batch_size, "max_batch_size"
        if matches(self.parts, _DATUMS):
            return chunk_datums(b.max_batch_size), "max_batch_size"
        if matches(self.parts, _PER_TARGET):
            return b.max_seq_length * MAX_TARGET_COLUMNS, f"{MAX_TARGET_COLUMNS} x max_seq_length"
        if matches(self.parts, _PER_TOKEN):
            return b.max_seq_length, "max_seq_length"
        return None

    def _token_prefix(self) -> int | None:
        for pattern, prefix in _TOKENS:
            if matches(self.parts, (pattern,)):
                return prefix
        return None

    def _over(self, count: int, cap: tuple[int, str]) -> BodyError:
        where = format_path(self.parts) or "body"
        what = "samples" if cap[1] == "max_batch_size" else "values"
        return field_error(where, f"more than {cap[0]} {what}: {cap[1]} is {cap[0]}")

    def _add_tokens(self, prefix: int, n: int) -> None:
        b = self.bounds
        owner = format_path(self.parts[:prefix])
        total = self.tokens.get(owner, 0) + n
        if total > b.max_seq_length:
            raise field_error(
                owner, f"at least {total} tokens exceed max_seq_length {b.max_seq_length}"
            )
        call = self.tokens.get("", 0) + n
        if call > b.max_tokens_per_call:
            root = format_path(self.parts[: prefix - 1]) if prefix > 1 else owner
            raise field_error(
                root.split("[")[0] or root,
                f"at least {call} tokens in all exceed max_tokens_per_call "
                f"{b.max_tokens_per_call}; split the call",
            )
        self.tokens[owner], self.tokens[""] = total, call

    # -- values ----------------------------------------------------------------------------

    def _value(self, depth: int) -> Any:
        raw, pos = self.raw, self.pos
        if pos >= len(raw):
            raise _syntax(raw, "Expecting value", pos)
        first = raw[pos]
        if first == 0x7B:  # {
            return self._object(depth)
        if first == 0x5B:  # [
            return self._array(depth)
        self._count()
        if first == 0x22:  # "
            value, self.pos = self._string(pos)
            return value
        return self._scalar(pos)

    def _string(self, pos: int) -> tuple[str, int]:
        match = _STRING.match(self.raw, pos)
        if match is None:
            raise _syntax(self.raw, "Unterminated string starting at", pos)
        token = match.group()
        try:
            text: str = orjson.loads(token)
        except orjson.JSONDecodeError:
            try:  # lone surrogates: the standard library keeps them
                text = json.loads(token)
            except json.JSONDecodeError as exc:
                raise _syntax(self.raw, exc.msg, pos + exc.pos) from None
            except UnicodeDecodeError as exc:
                raise BodyError("invalid_json", str(exc), "body") from None
        return text, match.end()

    def _scalar(self, pos: int) -> Any:
        match = _SCALAR.match(self.raw, pos)
        if match is None:
            raise _syntax(self.raw, "Expecting value", pos)
        token = match.group()
        self.pos = match.end()
        if token in _LITERALS:
            return _LITERALS[token]
        if token.lstrip(b"-").isdigit():
            if len(token) > 20 or not INT64_MIN <= (value := int(token)) <= INT64_MAX:
                raise out_of_range(self.parts, token.decode())
            return value
        return json.loads(token)

    def _object(self, depth: int) -> dict[str, Any]:
        if depth > MAX_DEPTH:
            raise too_deep(self.parts)
        self._count()
        raw = self.raw
        out: dict[str, Any] = {}
        cap = self.bounds.max_inputs if matches(self.parts, _INPUTS) else None
        pos = _WS.match(raw, self.pos + 1).end()  # type: ignore[union-attr]
        if raw[pos : pos + 1] == b"}":
            self.pos = pos + 1
            return out
        while True:
            if raw[pos : pos + 1] != b'"':
                raise _syntax(raw, "Expecting property name enclosed in double quotes", pos)
            key, pos = self._string(pos)
            pos = _WS.match(raw, pos).end()  # type: ignore[union-attr]
            if raw[pos : pos + 1] != b":":
                raise _syntax(raw, "Expecting ':' delimiter", pos)
            self.pos = _WS.match(raw, pos + 1).end()  # type: ignore[union-attr]
            self.parts.append(key)
            if cap is not None and key not in out and len(out) >= cap:
                raise field_error(format_path(self.parts[:-1]), f"more than {cap} inputs")
            out[key] = self._value(depth + 1)
            self.parts.pop()
            pos = _WS.match(raw, self.pos).end()  # type: ignore[union-attr]
            if raw[pos : pos + 1] == b",":
                pos = _WS.match(raw, pos + 1).end()  # type: ignore[union-attr]
                continue
            if raw[pos : pos + 1] == b"}":
                self.pos = pos + 1
                return out
            raise _syntax(raw, "Expecting ',' delimiter", pos)

    def _array(self, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise too_deep(self.parts)
        self._count()
        cap = self._cap()
        match = _NUM_ARRAY.match(self.raw, self.pos)
        if match is not None:
            return self._numeric(match.start(), match.end(), cap)
        items = self._elements(depth, cap)
        if (prefix := self._token_prefix()) is not None:
            self._add_tokens(prefix, len(items))
        return self._maybe_pack(items)

    def _numeric(self, start: int, end: int, cap: tuple[int, str] | None) -> Any:
        raw = self.raw
        inner = _WS.match(raw, start + 1).end()  # type: ignore[union-attr]
        n = 0 if raw[inner : inner + 1] == b"]" else raw.count(b",", start, end) + 1
        if cap is not None and n > cap[0]:
            raise self._over(n, cap)
        if (prefix := self._token_prefix()) is not None:
            self._add_tokens(prefix, n)
        elif cap is None and not matches(self.parts, PACKED_PATHS):
            self._count(n)
        self.pos = end
        items = _numbers(raw[start:end])
        for index, item in enumerate(items):
            if type(item) is str:  # an integer literal past 20 digits
                raise out_of_range([*self.parts, index], item)
        check_ints(items, self.parts)
        return self._maybe_pack(items)

    def _maybe_pack(self, items: list[Any]) -> Any:
        if self.packer is None or not items or not matches(self.parts, PACKED_PATHS):
            return items
        array = pack(items, floats=self.parts[-1] == "data")
        if array is None:
            return items
        self.packer.add(self.parts, array)
        return None

    def _elements(self, depth: int, cap: tuple[int, str] | None) -> list[Any]:
        raw = self.raw
        out: list[Any] = []
        pos = _WS.match(raw, self.pos + 1).end()  # type: ignore[union-attr]
        if raw[pos : pos + 1] == b"]":
            self.pos = pos + 1
            return out
        while True:
            if cap is not None and len(out) >= cap[0]:
                raise self._over(len(out) + 1, cap)
            self.pos = pos
            self.parts.append(len(out))
            out.append(self._value(depth + 1))
            self.parts.pop()
            pos = _WS.match(raw, self.pos).end()  # type: ignore[union-attr]
            if raw[pos : pos + 1] == b",":
                pos = _WS.match(raw, pos + 1).end()  # type: ignore[union-attr]
                continue
            if raw[pos : pos + 1] == b"]":
                self.pos = pos + 1
                return out
            raise _syntax(raw, "Expecting ',' delimiter", pos)


def _utf8(raw: bytes) -> bytes:
    """The body as UTF-8 (the standard library also reads UTF-16 and UTF-32 bodies)."""
    encoding = json.detect_encoding(raw[:4])
    if encoding == "utf-8":
        return raw
    try:
        return raw.decode(encoding).encode("utf-8", "surrogatepass")
    except UnicodeError as exc:
        raise BodyError("invalid_json", str(exc), "body") from None


def decode_body(
    raw: bytes, bounds: Bounds | None = None, packer: Packer | None = None, *, empty_ok: bool = True
) -> dict[str, Any]:
    """A request body as a checked dict (`{}` for an empty one if `empty_ok`); with a
    packer, its bulk arrays go to the packer's file and stand as None."""
    if empty_ok and not raw.strip():
        return {}
    value = Scanner(_utf8(raw), bounds or Bounds(), packer).run()
    if not isinstance(value, dict):
        raise BodyError("not_object", "must be a JSON object", "body")
    return value


def decode_object(
    raw: bytes, *, empty_ok: bool = True, bounds: Bounds | None = None
) -> dict[str, Any]:
    """A request body as a checked dict, nothing packed."""
    return decode_body(raw, bounds, empty_ok=empty_ok)
