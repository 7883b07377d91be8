"""JSON request bodies: decoded within bounds, their bulk numbers packed into arrays.

Design notes: `docs/design/serving.md`.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import re
import signal
import sys
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import orjson

MAX_DEPTH = 64
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
_EXACT_FLOAT_INT = 1 << 53  # integers that float64 holds exactly

_ANY = object()  # a path wildcard: any key or index
PACKED_PATHS: tuple[tuple[Any, ...], ...] = (
    ("samples", _ANY, "model_input", "chunks", _ANY, "encoded_text", "tokens"),
    ("samples", _ANY, "loss_fn_inputs", _ANY, "data"),
    ("gradients", _ANY, "data"),
    ("model_inputs", _ANY, "chunks", _ANY, "encoded_text", "tokens"),
)
_LONG_DIGITS = re.compile(rb"[0-9]{19}")
_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{},:]', re.DOTALL)


class BodyError(ValueError):
    """A body refused. `kind`: invalid_json (message = the decoder's), not_object, field
    (message names the path, `param` is it); and, not the body's fault: memory, storage,
    missing (file gone), crash, timeout, busy."""

    def __init__(self, kind: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "message": self.message, "param": self.param}


class _BigInt:
    """An integer literal too long to convert (stdlib path): refused with its path."""

    def __init__(self, text: str) -> None:
        self.text = text


def _parse_int(text: str) -> int | _BigInt:
    return int(text) if len(text) <= 20 else _BigInt(text)


def format_path(parts: list[Any] | tuple[Any, ...]) -> str:
    """`["samples", 0, "model_input"]` -> `samples[0].model_input` (as the 400s spell it)."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _too_deep(parts: list[Any]) -> BodyError:
    path = format_path(parts)
    where = path or "body"
    return BodyError("field", f"{where}: JSON nested deeper than {MAX_DEPTH} levels", where)


def _out_of_range(parts: list[Any], value: int | _BigInt) -> BodyError:
    text = value.text if isinstance(value, _BigInt) else str(value)
    digits = len(text.lstrip("-"))
    shown = text if digits <= 24 else f"{text[:12]}...({digits} digits)"
    path = format_path(parts) or "body"
    return BodyError(
        "field", f"{path}: integer {shown} is outside the int64 range [-2**63, 2**63-1]", path
    )


def decode(raw: bytes) -> Any:
    """Any JSON value, as `json.loads` reads it; `BodyError` for invalid or too-deep JSON."""
    if not _LONG_DIGITS.search(raw):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass  # the standard library decides, with its own message
    try:
        return json.loads(raw, parse_int=_parse_int)
    except RecursionError:
        raise _too_deep(_path_at_depth(raw)) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BodyError("invalid_json", str(exc), "body") from None


def _path_at_depth(raw: bytes) -> list[Any]:
    """Where the first container past `MAX_DEPTH` opens (only on the deep-nesting error path)."""
    frames: list[list[Any]] = []  # [is_object, key or index, expecting a key]
    for match in _TOKENS.finditer(raw):
        token = match.group()
        first = token[:1]
        if first == b'"':
            if frames and frames[-1][0] and frames[-1][2]:
                try:
                    frames[-1][1] = json.loads(token)
                except ValueError:
                    frames[-1][1] = token.decode(errors="replace")[1:-1]
        elif first in (b"{", b"["):
            if len(frames) >= MAX_DEPTH:
                return [frame[1] for frame in frames]
            frames.append([first == b"{", None if first == b"{" else 0, True])
        elif first in (b"}", b"]"):
            if frames:
                frames.pop()
        elif first == b"," and frames:
            if frames[-1][0]:
                frames[-1][2] = True
            else:
                frames[-1][1] += 1
        elif first == b":" and frames:
            frames[-1][2] = False
    return []


def _matches(parts: list[Any]) -> bool:
    for pattern in PACKED_PATHS:
        if len(pattern) == len(parts) and all(
            p is _ANY or p == q for p, q in zip(pattern, parts, strict=True)
        ):
            return True
    return False


def _check_int(value: int | _BigInt, parts: list[Any]) -> None:
    if type(value) is _BigInt or not INT64_MIN <= value <= INT64_MAX:  # type: ignore[operator]
        raise _out_of_range(parts, value)


def _check_ints(items: list[Any], kinds: set[type], parts: list[Any]) -> None:
    if _BigInt in kinds:
        index = next(i for i, x in enumerate(items) if type(x) is _BigInt)
        raise _out_of_range([*parts, index], items[index])
    if int in kinds:
        ints = items if kinds == {int} else [x for x in items if type(x) is int]
        if min(ints) < INT64_MIN or max(ints) > INT64_MAX:
            index = next(
                i for i, x in enumerate(items) if type(x) is int and not INT64_MIN <= x <= INT64_MAX
            )
            raise _out_of_range([*parts, index], items[index])


def _pack(items: list[Any], floats: bool) -> np.ndarray | None:
    """A list of numbers as the int64/float64 array holding exactly the same values, or None."""
    kinds = set(map(type, items))
    if kinds == {int}:
        if min(items) < INT64_MIN or max(items) > INT64_MAX:
            return None  # refused with its path by `_check`
        return np.array(items, dtype=np.int64)
    if floats and kinds == {float}:
        return np.array(items, dtype=np.float64)
    if floats and kinds == {int, float}:
        ints = [x for x in items if type(x) is int]
        if min(ints) >= -_EXACT_FLOAT_INT and max(ints) <= _EXACT_FLOAT_INT:
            return np.array(items, dtype=np.float64)
    return None


class Packer:
    """Appends packed arrays to one binary file; remembers where each one belongs."""

    def __init__(self, handle: BinaryIO) -> None:
        self.handle = handle
        self.paths: list[str] = []
        self.kinds: list[str] = []
        self.counts: list[int] = []

    def add(self, parts: list[Any], array: np.ndarray) -> None:
        self.handle.write(array.data)
        self.paths.append(json.dumps(parts, separators=(",", ":")))
        self.kinds.append("i" if array.dtype == np.int64 else "f")
        self.counts.append(int(array.shape[0]))

    def reply(self) -> dict[str, Any]:
        return {"paths": self.paths, "kinds": "".join(self.kinds), "counts": self.counts}


def check(value: Any, packer: Packer | None = None) -> None:
    """Depth and int64 bounds over a decoded body; with a packer, pack its bulk arrays."""
    _check(value, [], 1, packer)


def _check(value: Any, parts: list[Any], depth: int, packer: Packer | None) -> None:
    if type(value) is dict:
        if depth > MAX_DEPTH:
            raise _too_deep(parts)
        for key, item in value.items():
            kind = type(item)
            if kind is int or kind is _BigInt:
                _check_int(item, [*parts, key])
            elif kind is dict or kind is list:
                parts.append(key)
                if packer is not None and kind is list and item and _matches(parts):
                    array = _pack(item, floats=key == "data")
                    if array is not None:
                        packer.add(parts, array)
                        value[key] = None
                        parts.pop()
                        continue
                _check(item, parts, depth + 1, packer)
                parts.pop()
    elif type(value) is list:
        if depth > MAX_DEPTH:
            raise _too_deep(parts)
        kinds = set(map(type, value))
        _check_ints(value, kinds, parts)
        if dict in kinds or list in kinds:
            for index, item in enumerate(value):
                if type(item) is dict or type(item) is list:
                    parts.append(index)
                    _check(item, parts, depth + 1, packer)
                    parts.pop()
    elif type(value) is int or type(value) is _BigInt:
        _check_int(value, parts)


def decode_object(raw: bytes, *, empty_ok: bool = True) -> dict[str, Any]:
    """A request body as a checked dict (`{}` for an empty one if `empty_ok`), nothing packed."""
    if empty_ok and not raw.strip():
        return {}
    value = decode(raw)
    if not isinstance(value, dict):
        raise BodyError("not_object", "must be a JSON object", "body")
    check(value)
    return value


def parse_file(src: Path, blob: Path, pack: bool, empty_ok: bool) -> dict[str, Any]:
    """The child's work for one request: the reply's `skeleton` and `arrays`."""
    raw = src.read_bytes()
    if empty_ok and not raw.strip():
        return {"skeleton": {}, "arrays": None}
    value = decode(raw)
    del raw
    if not isinstance(value, dict):
        raise BodyError("not_object", "must be a JSON object", "body")
    with blob.open("wb") as handle:
        packer = Packer(handle) if pack else None
        check(value, packer)
    return {"skeleton": value, "arrays": packer.reply() if packer is not None else None}


def _reply(request: dict[str, Any]) -> dict[str, Any]:
    src, blob = Path(request["src"]), Path(request["blob"])
    try:
        return {"ok": True, **parse_file(src, blob, request["pack"], request["empty_ok"])}
    except BodyError as exc:
        return {"ok": False, **exc.as_dict()}
    except MemoryError:
        error = BodyError("memory", "the request body is too large to parse in memory")
    except FileNotFoundError as exc:
        error = BodyError("missing", f"no such file: {exc.filename}")
    except OSError as exc:
        kind = "storage" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "crash"
        error = BodyError(kind, f"parsing the request body failed: {exc.strerror}")
    return {"ok": False, **error.as_dict()}


def _trim() -> None:
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def main() -> None:
    """The child process: one request per stdin line, one reply per stdout line."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the worker decides when the child stops
    out = sys.stdout
    for line in sys.stdin:
        reply = _reply(json.loads(line))
        # allow_nan and ASCII escapes: a skeleton may hold NaN or lone surrogates
        out.write(json.dumps(reply, separators=(",", ":")) + "\n")
        out.flush()
        del reply
        _trim()  # hand the parse's memory back to the system while idle


if __name__ == "__main__":
    main()
