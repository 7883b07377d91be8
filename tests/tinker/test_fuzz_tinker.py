"""Fuzz the Tinker face's POST routes with mutated valid bodies, against the real worker.

A seeded generator starts from a valid body for each route (`tinker_http.valid_bodies`, ids of
live records, so mutations reach the validators and the engine, not just 404s) and mutates it:
drops, duplicates (a repeated JSON key) and retypes fields at any depth, puts extreme numbers
(NaN, infinities, 2**63, -0.0), negative and huge seq ids, deep nesting and hostile Unicode
(NUL, bidi overrides, astral characters, lone surrogates) in its leaves, or cuts the JSON
text; `forward_backward` also gets its protobuf body with bytes flipped, cut, inserted or
appended. After every request:

- no response is >= 500;
- a refusal (4xx) is the service's error body, and its message names its `param`;
- a refusal, or a request whose future fails, leaves the pinned model's weights, gradients and
  step exactly as they were (read in-process);
- an accepted request's future settles (result, or `{"error", "category"}`), never hangs.

Then the worker still serves valid requests (a forward on the pinned model, a new model).
`TRAINER_TINKER_FUZZ` sets the number of requests (default 300; 10x under `TRAINER_SLOW=1`),
`TRAINER_TINKER_FUZZ_SEED` the seed.

The read routes (GET, DELETE) get a sweep of hostile path and query values instead
(`test_path_and_query_values_of_every_read_route`).
"""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.conftest import LiveServer, serve_in_thread
from tests.tinker import tinker_http as th
from trainer.api.tinker import proto

EXAMPLES = int(os.environ.get("TRAINER_TINKER_FUZZ", "300"))
if os.environ.get("TRAINER_SLOW") == "1":
    EXAMPLES *= 10
SEED = int(os.environ.get("TRAINER_TINKER_FUZZ_SEED", "1313"))
PROTO_ROUTE = "/forward_backward (protobuf)"
PROTO_HEADERS = {"content-type": proto.PROTOBUF}
JSON_HEADERS = {"content-type": "application/json"}
LIMITS = {"max_seq_length": 32, "max_batch_size": 4, "max_tokens_per_call": 96}

EXTREME: list[Any] = [
    0,
    -1,
    1,
    -(2**31),
    2**31,
    2**63,
    -(2**63) - 1,
    2**64,
    10**40,
    1e308,
    -1e308,
    5e-324,
    -0.0,
    float("nan"),
    float("inf"),
    float("-inf"),
    0.5,
]
STRINGS: list[str] = [
    "",
    " ",
    "\x00",
    "\u202e\U0001f600\r\n",
    "\ud800",  # a lone surrogate (escaped in the JSON text)
    "tinker://",
    "tinker://../../etc/passwd",
    "../" * 50,
    "é" * 3000,
    "x" * 70_000,
    "cross_entropy",
    "importance_sampling",
    "stable_reinforce",
    "adamw",
    "int64",
    "float32",
]
OTHERS: list[Any] = [None, True, False, [], {}, [1, 2, 3], {"a": 1}, [[[[[]]]]], ["x"] * 100]


DEEP = "__deep_nesting__"  # replaced in the JSON text by arrays nested `DEPTHS` deep
DEPTHS = (10, 900, 5_000, 100_000)


def deep_text(depth: int) -> str:
    return "[" * depth + "0" + "]" * depth


def random_value(rng: random.Random) -> Any:
    pick = rng.random()
    if pick < 0.4:
        return rng.choice(EXTREME)
    if pick < 0.7:
        return rng.choice(STRINGS)
    if pick < 0.9:
        return json.loads(json.dumps(rng.choice(OTHERS)))  # a fresh copy
    return f"{DEEP}{rng.choice(DEPTHS)}"


def paths(node: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every path to a value inside a JSON document (lists capped at their first 4 items)."""
    yield prefix
    if len(prefix) > 8:
        return
    if isinstance(node, dict):
        for key, value in node.items():
            yield from paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node[:4]):
            yield from paths(value, (*prefix, i))


def get(node: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        node = node[part]
    return node


def mutate_bytes(body: bytes, rng: random.Random) -> bytes:
    """A protobuf body with bytes flipped, cut, inserted or appended."""
    data = bytearray(body)
    roll = rng.random()
    if roll < 0.5:
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
    elif roll < 0.7:
        del data[rng.randrange(len(data)) :]
    elif roll < 0.9:
        at = rng.randrange(len(data))
        data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
    else:
        data += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    return bytes(data)


def mutate(body: dict[str, Any], rng: random.Random) -> bytes:
    """One mutation (or a few) of a valid body, as the JSON text to send."""
    doc = json.loads(json.dumps(body))
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        targets = [p for p in paths(doc) if p]
        if not targets:
            break
        path = rng.choice(targets)
        parent, last = get(doc, path[:-1]), path[-1]
        kind = rng.random()
        if kind < 0.2:  # drop
            del parent[last]
        elif kind < 0.3 and isinstance(parent, list):  # duplicate a list item
            parent.insert(last, json.loads(json.dumps(parent[last])))
        elif kind < 0.45 and "seq" in str(last):  # seq ids: negative and huge
            parent[last] = rng.choice([-1, -(2**31), 2**31, 2**63, 10**30, "1", 1.5])
        elif kind < 0.6 and isinstance(get(doc, path), int | float):  # extreme numbers
            parent[last] = rng.choice(EXTREME)
        else:  # retype
            parent[last] = random_value(rng)
    text = json.dumps(doc)  # NaN and Infinity go out as the bare words Python writes
    for depth in DEPTHS:
        text = text.replace(f'"{DEEP}{depth}"', deep_text(depth))
    roll = rng.random()
    if roll < 0.05 and isinstance(doc, dict) and doc:  # a duplicated key, last one different
        key = rng.choice(list(doc))
        text = text[:-1] + f", {json.dumps(key)}: {json.dumps(random_value(rng))}" + "}"
    elif roll < 0.08:  # cut short
        text = text[: rng.randrange(len(text))]
    return text.encode("utf-8", "surrogatepass")


@pytest.fixture
def fuzzed(tiny_qwen_dir: Path, tmp_path: Path) -> Iterator[tuple[LiveServer, str, str]]:
    model = [{"name": th.BASE, "location": str(tiny_qwen_dir), **LIMITS}]
    with serve_in_thread(tmp_path / "storage", {}, model=model, max_body_bytes=1 << 16) as live:
        with th.client(live) as http:
            session = th.new_session(http)
            pinned = th.new_model(http, session, seq=0)
            victim = th.new_model(http, session, seq=1)
        yield live, pinned, victim


def settle(http: httpx.Client, response: httpx.Response) -> dict[str, Any] | None:
    """An accepted request's settled future (None for routes that answer at once)."""
    body = response.json()
    if not isinstance(body, dict) or "request_id" not in body:
        return None
    result = th.wait(http, body["request_id"], timeout=120)
    if "error" in result:  # bad input fails as the user's error, never as a crash
        assert set(result) == {"error", "category"}, result
        assert result["category"] == "user" and result["error"], result
    return result


def test_fuzz_the_tinker_routes(fuzzed: tuple[LiveServer, str, str]) -> None:
    live, pinned, victim = fuzzed
    rng = random.Random(SEED)
    statuses: dict[int, int] = {}
    failed_futures = 0
    with th.client(live, timeout=120) as http:
        valid = th.valid_bodies(http, pinned, victim)
        routes = [*sorted(valid), PROTO_ROUTE]
        good_proto = th.fb_proto(pinned)
        accepted = http.post("/forward_backward", content=good_proto, headers=PROTO_HEADERS)
        assert "error" not in th.wait(http, accepted.json()["request_id"]), "the proto body"
        for n in range(EXAMPLES):
            route = routes[n % len(routes)] if n < len(routes) else rng.choice(routes)
            if route == PROTO_ROUTE:
                route, data, headers = (
                    "/forward_backward",
                    mutate_bytes(good_proto, rng),
                    PROTO_HEADERS,
                )
            else:
                data, headers = mutate(valid[route], rng), JSON_HEADERS
            before = th.fingerprint(live, pinned)
            response = http.post(route, content=data, headers=headers)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            assert response.status_code < 500, (route, data[:2000], response.text[:500])
            if response.status_code >= 400:
                th.check_refusal(response)
                assert th.fingerprint(live, pinned) == before, (route, data[:300])
                continue
            result = settle(http, response)
            if result is not None and "error" in result:
                failed_futures += 1
                assert th.fingerprint(live, pinned) == before, (route, data[:300], result)
        # the worker still serves: the pinned model, and a new one
        assert len(th.forward(http, pinned)) == len(th.TOKENS) - 1
        fresh = th.new_model(http, seq=7)
        th.ok(http, "/forward_backward", th.fb_body(fresh))
        assert th.ok(http, "/optim_step", th.optim_body(fresh))["metrics"]["grad_norm"] > 0
    refusals = sum(v for k, v in statuses.items() if k >= 400)
    print(
        f"{EXAMPLES} requests, statuses {dict(sorted(statuses.items()))}, {failed_futures} failed"
    )
    assert sum(statuses.values()) == EXAMPLES
    assert refusals >= EXAMPLES // 3, statuses  # the mutations reach the validators
    assert statuses.get(200, 0) >= EXAMPLES // 20, statuses  # and some reach the engine


NASTY = [
    "",
    "abc",
    "-1",
    "0",
    "1e3",
    "NaN",
    "\u0663",  # int() reads 3
    "\x00",
    "%00",
    "..",
    "a/b",
    "\u202e\U0001f600",
    "\ud800",
    "9" * 30,  # past SQLite's 64-bit integers
    "9" * 5_000,  # past int()'s 4,300-digit limit
    "x" * 3_000,
]


def test_path_and_query_values_of_every_read_route(fuzzed: tuple[LiveServer, str, str]) -> None:
    """Every GET and DELETE route of the face, each path parameter and `limit` / `offset` set
    to each `NASTY` value (the others genuine ids): never a 5xx, refusals in the error shape."""
    from urllib.parse import quote

    live, pinned, _ = fuzzed
    genuine = {"checkpoint_id": "weights/k"}
    statuses: dict[int, int] = {}
    with th.client(live, timeout=30) as http:
        th.ok(http, "/save_weights", {"model_id": pinned, "path": "k"})
        sampler = http.post(
            "/create_sampling_session",
            json={
                "session_id": pinned.split(":")[0],
                "sampling_session_seq_id": 0,
                "base_model": th.BASE,
            },
        ).json()["sampling_session_id"]
        ids = {"sampler_id": sampler, "sampling_session_id": sampler}
        routes = [(m, p) for m, p in th.face_routes(live.app) if m in ("GET", "DELETE")]
        assert len(routes) >= 8, routes
        before = th.fingerprint(live, pinned)

        def send(method: str, path: str, values: dict[str, str], query: str = "") -> None:
            url = path
            for name, value in values.items():
                url = url.replace(f"{{{name}}}", value)
            response = http.request(method, url.removeprefix(th.PREFIX) + query)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            assert response.status_code < 500, (method, url[:200], query[:200], response.text)
            if response.status_code >= 400:
                th.check_refusal(response)

        for method, path in routes:
            template = re.sub(r"\{(\w+)(:\w+)?\}", r"{\1}", path)
            names = re.findall(r"\{(\w+)\}", template)
            good = {n: ids.get(n, genuine.get(n, pinned)) for n in names}
            for value in NASTY:
                quoted = quote(value.encode("utf-8", "surrogatepass"), safe="/")
                for name in names:
                    send(method, template, {**good, name: quoted})
                if method == "GET":
                    for param in ("limit", "offset"):
                        send(method, template, good, f"?{param}={quoted}")
    assert th.fingerprint(live, pinned) == before
    print(f"read routes: statuses {dict(sorted(statuses.items()))}")
