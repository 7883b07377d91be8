"""A small protobuf wire codec: messages declared as tables, read into dicts and written back.

No generated code and no `protobuf` package. A message is a `Schema`, field number -> `Field`;
`read_message` and `write_message` walk it. Wire rules kept (protobuf encoding spec):
- a field is a varint tag `number << 3 | wire_type`; wire types 0 varint, 1 fixed64,
  2 length-delimited, 5 fixed32; groups (3/4) are only skipped, as unknown fields;
- unknown fields are skipped; the last value of a singular field wins; a singular message seen
  twice is merged (its bytes are concatenated); repeated varints come packed or not;
- a map is a repeated entry message with the key (a string here) in field 1, the value in 2.
Every malformed body raises `ProtoError` naming the field path; a declared length is checked
against the bytes left before anything is allocated. With `Caps`, the fields read in all, the
elements of each capped repeated field or map, and the times a singular message is set are
counted as they are read and refused (naming the field) past their cap, so a body costs
memory and time in proportion to what the caps allow.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class ProtoError(ValueError):
    """A malformed protobuf body; `field` is the path of the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


# --- tables --------------------------------------------------------------------------------

VARINT, FIXED64, LEN, START_GROUP, END_GROUP, FIXED32 = 0, 1, 2, 3, 4, 5

# scalar kinds -> their wire type
_WIRE = {
    "int32": VARINT,
    "int64": VARINT,
    "uint32": VARINT,
    "enum": VARINT,
    "bool": VARINT,
    "double": FIXED64,
    "string": LEN,
    "bytes": LEN,
    "message": LEN,
    "map": LEN,
}
_DEFAULT: dict[str, Any] = {
    "int32": 0,
    "int64": 0,
    "uint32": 0,
    "enum": 0,
    "bool": False,
    "double": 0.0,
    "string": "",
    "bytes": b"",
}


@dataclass(frozen=True)
class Field:
    """One field of a message: `kind` is a scalar kind, "message" or "map" (string keys)."""

    name: str
    kind: str
    repeated: bool = False
    message: Schema | None = None  # the schema of a message, or of a map's message value
    value: str = ""  # a map's value kind
    oneof: str = ""  # the oneof group; setting one member clears the others
    cap: str = ""  # the `Caps.counts` entry bounding a repeated field's or a map's elements


Schema = Mapping[int, Field]
MAX_MERGES = 16  # times one singular message may be set (and merged) in one parent


@dataclass
class Caps:
    """What one read may hold: `fields` in all (each tag read counts one, each packed value
    one), and per capped field (`Field.cap`) its elements in one message."""

    fields: int
    counts: Mapping[str, int]
    read: int = 0

    def tick(self, path: str, n: int = 1) -> None:
        self.read += n
        if self.read > self.fields:
            raise ProtoError(path, f"the body holds more than {self.fields} fields")

    def check(self, field: Field, seen: dict[str, int], path: str) -> None:
        """One more element of `field` in this message (map entries count, repeated keys too)."""
        if not field.cap:
            return
        count = seen[field.name] = seen.get(field.name, 0) + 1
        cap = self.counts.get(field.cap)
        if cap is not None and count > cap:
            raise ProtoError(path, f"more than {cap} {field.name} entries")


# --- reading --------------------------------------------------------------------------------


def _varint(buf: memoryview, pos: int, path: str) -> tuple[int, int]:
    value = shift = 0
    for i in range(pos, min(pos + 10, len(buf))):
        byte = buf[i]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value & 0xFFFF_FFFF_FFFF_FFFF, i + 1
        shift += 7
    raise ProtoError(path, "truncated or over-long varint")


def _length(buf: memoryview, pos: int, path: str) -> tuple[int, int]:
    size, pos = _varint(buf, pos, path)
    if size > len(buf) - pos:
        raise ProtoError(path, f"length {size} runs past the end ({len(buf) - pos} bytes left)")
    return size, pos


def _signed(value: int, bits: int) -> int:
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >> (bits - 1) else value


def _skip(buf: memoryview, pos: int, wire: int, number: int, path: str) -> int:
    """The position after an unknown field's value (groups included, nested or not)."""
    groups: list[int] = []
    while True:
        if wire == VARINT:
            pos = _varint(buf, pos, path)[1]
        elif wire in (FIXED64, FIXED32):
            pos += 8 if wire == FIXED64 else 4
            if pos > len(buf):
                raise ProtoError(path, "truncated fixed-width value")
        elif wire == LEN:
            size, pos = _length(buf, pos, path)
            pos += size
        elif wire == START_GROUP:
            if len(groups) == 32:
                raise ProtoError(path, "groups nested deeper than 32")
            groups.append(number)
        elif wire == END_GROUP and groups and groups[-1] == number:
            groups.pop()
        else:
            raise ProtoError(path, f"unexpected wire type {wire} for field {number}")
        if not groups:
            return pos
        if pos >= len(buf):
            raise ProtoError(path, "unterminated group")
        tag, pos = _varint(buf, pos, path)
        wire, number = tag & 7, tag >> 3


def _scalar(kind: str, buf: memoryview, pos: int, path: str) -> tuple[Any, int]:
    if kind == "double":
        if pos + 8 > len(buf):
            raise ProtoError(path, "truncated double")
        return struct.unpack_from("<d", buf, pos)[0], pos + 8
    if kind in ("bytes", "string"):
        size, pos = _length(buf, pos, path)
        raw = buf[pos : pos + size]
        if kind == "bytes":
            return raw, pos + size
        try:
            return str(raw, "utf-8"), pos + size
        except UnicodeDecodeError:
            raise ProtoError(path, "string is not valid UTF-8") from None
    value, pos = _varint(buf, pos, path)
    if kind == "bool":
        return value != 0, pos
    if kind == "int64":
        return _signed(value, 64), pos
    if kind == "uint32":
        return value & 0xFFFF_FFFF, pos
    return _signed(value, 32), pos  # int32, enum


def _absent(field: Field) -> Any:
    """What an absent field reads as: proto3's default, or None for a message or oneof member."""
    if field.repeated or field.kind == "map":
        return [] if field.repeated else {}
    return None if field.kind == "message" or field.oneof else _DEFAULT[field.kind]


def _read(buf: memoryview, schema: Schema, path: str, caps: Caps) -> dict[str, Any]:
    """Parse one message into a dict keyed by field name, within `caps`.

    Absent scalars take their proto3 default, absent messages are None, repeated fields are
    lists and maps are dicts; bytes are zero-copy memoryviews into `buf`.
    """
    out: dict[str, Any] = {f.name: _absent(f) for f in schema.values()}
    singular_messages: dict[str, tuple[Field, list[memoryview]]] = {}
    seen: dict[str, int] = {}  # elements of each capped field
    pos = 0
    while pos < len(buf):
        caps.tick(path or "body")
        tag, pos = _varint(buf, pos, path or "body")
        number, wire = tag >> 3, tag & 7
        field = schema.get(number)
        if number == 0:
            raise ProtoError(path or "body", "field number 0")
        if field is None:
            pos = _skip(buf, pos, wire, number, f"{path or 'body'}.<field {number}>")
            continue
        here = f"{path}.{field.name}" if path else field.name
        if field.oneof:
            for other in schema.values():
                if other.oneof == field.oneof and other is not field:
                    out[other.name] = None
                    singular_messages.pop(other.name, None)
        if field.repeated and wire == LEN and _WIRE[field.kind] == VARINT:
            size, pos = _length(buf, pos, here)  # packed
            end = pos + size
            values = out[field.name]
            while pos < end:
                caps.tick(here)
                value, pos = _scalar(field.kind, buf[:end], pos, here)
                values.append(value)
                caps.check(field, seen, here)
            continue
        if wire != _WIRE[field.kind]:
            raise ProtoError(here, f"wire type {wire}, expected {_WIRE[field.kind]}")
        if field.kind == "message":
            size, pos = _length(buf, pos, here)
            raw = buf[pos : pos + size]
            pos += size
            if field.repeated:
                index = len(out[field.name])
                caps.check(field, seen, here)
                assert field.message is not None
                out[field.name].append(_read(raw, field.message, f"{here}[{index}]", caps))
            else:
                parts = singular_messages.setdefault(field.name, (field, []))[1]
                if len(parts) >= MAX_MERGES:
                    raise ProtoError(here, f"set more than {MAX_MERGES} times")
                parts.append(raw)
        elif field.kind == "map":
            size, pos = _length(buf, pos, here)
            caps.check(field, seen, here)
            entry_path = f"{here}[{len(out[field.name])}]"
            value_field = Field("value", field.value, message=field.message)
            entry = _read(
                buf[pos : pos + size], {1: Field("key", "string"), 2: value_field}, entry_path, caps
            )
            pos += size
            if entry["value"] is None:  # an entry without its message value: the empty message
                assert field.message is not None
                entry["value"] = _read(memoryview(b""), field.message, entry_path, caps)
            out[field.name][entry["key"]] = entry["value"]
        else:
            value, pos = _scalar(field.kind, buf, pos, here)
            if field.repeated:
                out[field.name].append(value)
                caps.check(field, seen, here)
            else:
                out[field.name] = value
    for name, (field, parts) in singular_messages.items():
        assert field.message is not None
        raw = parts[0] if len(parts) == 1 else memoryview(b"".join(parts))
        out[name] = _read(raw, field.message, f"{path}.{name}" if path else name, caps)
    return out


# --- writing --------------------------------------------------------------------------------


def _put_varint(out: bytearray, value: int) -> None:
    value &= 0xFFFF_FFFF_FFFF_FFFF  # negative ints: 64-bit two's complement, as protobuf
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)


def _put(out: bytearray, number: int, kind: str, value: Any, schema: Schema | None) -> None:
    _put_varint(out, number << 3 | _WIRE[kind])
    if kind == "double":
        out += struct.pack("<d", value)
    elif kind in ("bytes", "string", "message"):
        if kind == "message":
            assert schema is not None
            value = _write(value, schema)
        raw = value.encode() if kind == "string" else value
        _put_varint(out, len(raw))
        out += raw
    else:
        _put_varint(out, int(value))


def _write(msg: Mapping[str, Any], schema: Schema) -> bytes:
    """Serialise a dict laid out as `schema`; None and proto3 defaults are left out."""
    out = bytearray()
    for number, field in schema.items():
        value = msg.get(field.name)
        if value is None:
            continue
        if field.kind == "map":
            entry = {
                1: Field("key", "string"),
                2: Field("value", field.value, message=field.message),
            }
            for key, item in value.items():
                _put(out, number, "message", {"key": key, "value": item}, entry)
        elif field.repeated and field.kind == "message":
            for item in value:
                _put(out, number, "message", item, field.message)
        elif field.repeated:  # packed varints
            packed = bytearray()
            for item in value:
                _put_varint(packed, int(item))
            if packed:
                _put(out, number, "bytes", bytes(packed), None)
        elif field.kind == "message" or field.oneof or value != _DEFAULT[field.kind]:
            _put(out, number, field.kind, value, field.message)
    return bytes(out)


def read_message(body: bytes, schema: Schema, caps: Caps | None = None) -> dict[str, Any]:
    """Parse a whole body as one message laid out as `schema` (see `_read`), within `caps`."""
    return _read(memoryview(body), schema, "", caps or Caps(1 << 62, {}))


def write_message(msg: Mapping[str, Any], schema: Schema) -> bytes:
    """Serialise a dict laid out as `schema`; None values and proto3 defaults are left out."""
    return _write(msg, schema)
