"""Concurrent completions of one target, run as one engine `sample` call (docs/semantics.md
§25).

The Fireworks SDK sends a group of n completions as n requests of `n: 1` at once, and a
rollout loop sends its prompts' groups side by side. An engine session runs its operations one
at a time, so each request alone would decode its row after the others. Instead, requests for
the same target session with the same sampling settings (everything but the prompt: the same
`max_tokens`, temperature, filters, stops, logprob fields, `n`) and no `seed`, from the same
user, merge: while one merged call of such a `key` runs, the requests that arrive wait
together and then run as the next call, one prompt each (`model_inputs` in arrival order).
Each request gets its own prompt's result; a row's tokens and logprobs do not depend on the
rows beside it (the decode loop's guarantee). A request with a `seed` runs alone: its draws
are the seed's own.

A merged call's watch fans out: each request's stream gets its own rows after every decode
step, and the generation stops once every request of the call has gone.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Run = Callable[[list[Any]], dict[str, Any]]
"""Run one engine sample call of these members' prompts, in order: the operation's output."""


class FanOut:
    """The engine watch of a merged call: each member's watch (`stopped`, `step`) sees its own
    rows (`rows` per member, in order)."""

    def __init__(self, watches: list[Any], rows: int) -> None:
        self.watches, self.rows = watches, rows

    def stopped(self) -> bool:
        return all(w.stopped() for w in self.watches)

    def step(self, sequences: list[Any]) -> None:
        for i, watch in enumerate(self.watches):
            if not watch.stopped():
                watch.step(sequences[i * self.rows : (i + 1) * self.rows])


@dataclass
class _Batch:
    members: list[Any] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    results: list[dict[str, Any]] = field(default_factory=list)
    error: BaseException | None = None


class Merger:
    """The batches being formed, by key (`key`: None runs alone)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.forming: dict[str, _Batch] = {}  # key -> the batch new requests join
        self.running: dict[str, threading.Lock] = {}  # key -> held while one of its calls runs
        self.leaders: dict[str, int] = {}  # key -> batches made and not ended (the lock's users)

    def run(
        self, key: str | None, member: Any, run: Run, fits: Callable[[list[Any]], bool]
    ) -> dict[str, Any]:
        """`member`'s result (its prompt's), from a call it shares with the requests of the same
        `key` that wait with it (None: alone). A request that would take a forming batch past
        the engine's limits (`fits`) starts the next one instead."""
        if key is None:
            result: dict[str, Any] = run([member])["results"][0]
            return result
        with self.lock:
            batch = self.forming.get(key)
            leads = batch is None or not fits([*batch.members, member])
            if leads:
                batch = self.forming[key] = _Batch()
                self.leaders[key] = self.leaders.get(key, 0) + 1
            assert batch is not None
            index = len(batch.members)
            batch.members.append(member)
            gate = self.running.setdefault(key, threading.Lock())
        if leads:
            self._lead(key, batch, gate, run)
        batch.done.wait()
        if batch.error is not None:
            raise batch.error
        return batch.results[index]

    def _lead(self, key: str, batch: _Batch, gate: threading.Lock, run: Run) -> None:
        with gate:  # the call of this key before ours has ended: ours goes now
            with self.lock:
                if self.forming.get(key) is batch:
                    del self.forming[key]
            try:
                batch.results = list(run(batch.members)["results"])
            except BaseException as exc:  # every member fails alike
                batch.error = exc
            finally:
                batch.done.set()
                with self.lock:
                    self.leaders[key] -= 1
                    if not self.leaders[key]:
                        del self.leaders[key], self.running[key]
