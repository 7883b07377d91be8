"""The bounded JSON decoder reads what `json.loads` reads, and refuses at its bounds.

- 2,000 random documents (nested objects and arrays, numeric arrays, escapes, unicode, NaN,
  1e400, duplicate keys, big and negative integers, odd whitespace) decode to exactly what
  `json.loads` gives; invalid ones are refused as invalid JSON wherever `json.loads` refuses.
- A body of 200,000 keys in one object, or of 300,000 values in an unbounded array, is refused
  at `max_items` naming where it was, without building the rest.
"""

from __future__ import annotations

import json
import math
import random
from typing import Any

import pytest

from trainer.serving.jsonparse import BodyError, Bounds
from trainer.serving.jsonscan import decode_body

STRINGS = ["", "a", 'quo"te', "back\\slash", "tab\t", "é", "日本", "\U0001f600", "\u2028"]
NUMBERS: list[Any] = [0, -0.0, 1, -1, 2**53 + 1, -(2**63), 2**63 - 1, 1.5, 1e-300, 3.14159e10]


def _value(rng: random.Random, depth: int) -> Any:
    roll = rng.random()
    if depth > 4 or roll < 0.3:
        return rng.choice([*STRINGS, *NUMBERS, True, False, None])
    if roll < 0.5:
        return [rng.choice(NUMBERS) for _ in range(rng.randrange(0, 8))]
    if roll < 0.75:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    return {rng.choice(STRINGS) + str(i): _value(rng, depth + 1) for i in range(rng.randrange(4))}


def _text(rng: random.Random, value: Any) -> str:
    spaces = rng.choice([None, (",", ":"), (" , ", " : "), (",\n\t", ":\r\n")])
    return json.dumps({"body": value}, separators=spaces, ensure_ascii=rng.random() < 0.5)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or (
            a == b and math.copysign(1, a) == math.copysign(1, b)
        )
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def test_random_documents_decode_as_json_loads() -> None:
    rng = random.Random(5)
    for _ in range(2000):
        raw = _text(rng, _value(rng, 0)).encode()
        assert _same(decode_body(raw), json.loads(raw)), raw[:200]


@pytest.mark.parametrize(
    "raw",
    [
        b'{"a": [1, NaN, Infinity, -Infinity], "b": 1e400, "c": -1e400}',
        b'{"a": 1, "a": 2}',
        b'{"s": "\\ud800 lone", "t": "\\u00e9\\n"}',
        b'\xef\xbb\xbf{"bom": 1}',
        '{"utf16": [1, 2.5]}'.encode("utf-16"),
        b'{"big": 9223372036854775807, "neg": -9223372036854775808, "f": 1.0e+2}',
    ],
)
def test_edge_documents_decode_as_json_loads(raw: bytes) -> None:
    assert _same(decode_body(raw), json.loads(raw))


@pytest.mark.parametrize(
    "raw",
    [b'{"a": }', b'{"a" 1}', b'{"a": [1, 2,]}', b'{"a": 1,}', b'{"a": "x', b'{"a": 01}',
     b'{"a": tru}', b'{"a": 1} {}', b'{"a": "\x01"}', b'{"a": [1 2]}', b'{"a": .5}'],
)  # fmt: skip
def test_invalid_documents_are_refused_as_json_loads_refuses(raw: bytes) -> None:
    with pytest.raises(json.JSONDecodeError):
        json.loads(raw)
    with pytest.raises(BodyError) as caught:
        decode_body(raw)
    assert caught.value.kind == "invalid_json", caught.value


def test_many_keys_and_values_stop_at_max_items() -> None:
    bounds = Bounds(max_items=100_000)
    keys = ("{" + ",".join(f'"k{i}": 0' for i in range(200_000)) + "}").encode()
    with pytest.raises(BodyError) as caught:
        decode_body(keys, bounds)
    assert caught.value.param == "k99999" and "100000 JSON values" in caught.value.message
    values = ('{"junk": [' + ",".join(["0"] * 300_000) + "]}").encode()
    with pytest.raises(BodyError) as caught:
        decode_body(values, bounds)
    assert caught.value.param == "junk", caught.value
