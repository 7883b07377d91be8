"""`stable_reinforce` on the Tinker face (docs/semantics.md §13): what a sampling client with
`record_stability_info` records, and how a training request's provenance spans are resolved
against those records.

A record holds, for one returned sequence (`sequence_id`), its prompt tokens, its sampled
tokens, the float32 logprob the sampler computed for each sampled token and the weights
version that sampled it: what the generator that served the sample returned (the in-process
loop or a vLLM replica). Records live in `<storage>/tinker_stability.sqlite`, so a restart
keeps them; each belongs to the Tinker session that sampled it, expires `ttl_s` after its last
use (each training request that names it restarts the clock) and is kept within `max_bytes`,
least recently used dropped first: a session past its share of the budget loses its own
oldest records, never another session's (as routing-replay keys do).

A `stable_reinforce` datum tiles its `model_input` and its `target_tokens` with spans, each
naming a record and an offset into its prompt (`prompt_tokens`) or its sampled tokens
(`sampled_tokens`). `resolve` checks every span against its record and turns the datum into
the engine's `LOSS_TYPE_STABLE_REINFORCE` inputs: `logprobs` are the recorded ones under
sampled spans, `mask` keeps exactly those positions. On the wire a span is
`{"prompt_tokens": {"sequence_id", "offset", "length"}}` or the same under `sampled_tokens`
(the protobuf `ProvenanceSpan`'s arms; `trainer.api.tinker.proto` decodes to this shape).
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainer.api.tinker.convert_inputs import TinkerInputError
from trainer.serving.catalogue import open_db

PROMPT, SAMPLED = "prompt_tokens", "sampled_tokens"
SHARE_FLOOR = 16
"""A session's share of the byte budget is never below `max_bytes // SHARE_FLOOR`."""
UNKNOWN = (
    "names no stability record of this session (unknown, expired, or sampled by another "
    "session; sample with record_stability_info=True)"
)
_SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    sequence_id TEXT PRIMARY KEY, tinker_session TEXT, prompt BLOB, tokens BLOB,
    logprobs BLOB, version INTEGER, nbytes INTEGER, last_used_at REAL);
CREATE INDEX IF NOT EXISTS records_used ON records (last_used_at);
CREATE INDEX IF NOT EXISTS records_owner ON records (tinker_session, last_used_at);
"""


@dataclass(frozen=True)
class Record:
    """One sampled sequence as the sampler returned it."""

    sequence_id: str
    tinker_session: str
    prompt: np.ndarray  # int64 [prompt length]
    tokens: np.ndarray  # int64 [sampled length]
    logprobs: np.ndarray  # float32 [sampled length]
    version: int


@dataclass(frozen=True)
class Span:
    kind: str  # PROMPT | SAMPLED
    sequence_id: str
    offset: int
    length: int


@dataclass(frozen=True)
class Provenance:
    """A datum's spans over its `model_input` and over its `target_tokens`."""

    model_input: tuple[Span, ...]
    targets: tuple[Span, ...]


class StabilityRecords:
    """The records under one storage root. Thread-safe; `clock` is for tests."""

    def __init__(
        self, path: Path, ttl_s: float, max_bytes: int, clock: Callable[[], float] = time.time
    ) -> None:
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.clock = clock
        self._lock = threading.Lock()
        self._db = open_db(path, _SCHEMA)
        self._bytes = 0
        self._owned: dict[str, int] = {}  # tinker session -> bytes of its records
        self._recount()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM records").fetchone()[0])

    def share(self) -> int:
        """Bytes each session with records may hold: the budget split between them, and at
        least `max_bytes // SHARE_FLOOR`."""
        sessions = max(sum(1 for size in self._owned.values() if size > 0), 1)
        return max(self.max_bytes // sessions, self.max_bytes // SHARE_FLOOR)

    def session_bytes(self, tinker_session: str) -> int:
        with self._lock:
            return self._owned.get(tinker_session, 0)

    def put(self, records: Sequence[Record]) -> None:
        """Store `records` (one transaction), then drop expired records and, past its share of
        the byte budget, the writing session's least recently used ones (never another
        session's while it holds no more than its share)."""
        now = self.clock()
        rows = []
        for r in records:
            blobs = (
                r.prompt.astype("<i4").tobytes(),
                r.tokens.astype("<i4").tobytes(),
                r.logprobs.astype("<f4").tobytes(),
            )
            size = sum(len(b) for b in blobs) + len(r.sequence_id) + len(r.tinker_session)
            rows.append((r.sequence_id, r.tinker_session, *blobs, r.version, size, now))
        with self._lock:
            self._db.execute("BEGIN")
            try:
                for row in rows:
                    self._delete("sequence_id = ?", (row[0],))  # a replaced record's bytes
                    self._db.execute("INSERT INTO records VALUES (?, ?, ?, ?, ?, ?, ?, ?)", row)
                    self._count(str(row[1]), int(row[6]))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                self._recount()
                raise
            self._trim(now, {str(row[1]) for row in rows})

    def expire(self) -> int:
        """Drop the records unused for `ttl_s` (the periodic sweep); how many went."""
        with self._lock:
            return self._trim(self.clock(), set())

    def _count(self, tinker_session: str, size: int) -> None:
        self._bytes += size
        self._owned[tinker_session] = self._owned.get(tinker_session, 0) + size
        if self._owned[tinker_session] <= 0:
            del self._owned[tinker_session]

    def _recount(self) -> None:
        rows = self._db.execute(
            "SELECT tinker_session, SUM(nbytes) FROM records GROUP BY tinker_session"
        ).fetchall()
        self._owned = {str(session): int(size) for session, size in rows}
        self._bytes = sum(self._owned.values())

    def _trim(self, now: float, writers: set[str]) -> int:
        """Under the lock: expired records out; each writer over its share loses its least
        recently used; past the whole budget (more than `SHARE_FLOOR` sessions hold records),
        the least recently used of all."""
        gone = self._delete("last_used_at < ?", (now - self.ttl_s,))
        share = self.share()
        for session in writers:
            while self._owned.get(session, 0) > share:
                gone += self._drop_oldest(
                    self._owned[session] - share, "WHERE tinker_session = ?", (session,)
                )
        while self._bytes > self.max_bytes:
            gone += self._drop_oldest(self._bytes - self.max_bytes, "", ())
        return gone

    def _drop_oldest(self, need: int, where: str, params: tuple[Any, ...]) -> int:
        """The least recently used records (of `where`) holding at least `need` bytes."""
        oldest = self._db.execute(
            f"SELECT sequence_id, nbytes FROM records {where} "
            "ORDER BY last_used_at, sequence_id LIMIT 256",
            params,
        ).fetchall()
        dropped = []
        for sequence_id, size in oldest:
            dropped.append(sequence_id)
            need -= int(size)
            if need <= 0:
                break
        if not dropped:
            self._recount()  # the counts disagree with the table: trust the table
            return 0
        marks = ", ".join("?" for _ in dropped)
        return self._delete(f"sequence_id IN ({marks})", tuple(dropped))

    def _delete(self, where: str, params: tuple[Any, ...]) -> int:
        sizes = self._db.execute(
            f"SELECT tinker_session, SUM(nbytes), COUNT(*) FROM records WHERE {where} "
            "GROUP BY tinker_session",
            params,
        ).fetchall()
        if not sizes:
            return 0
        self._db.execute(f"DELETE FROM records WHERE {where}", params)
        for session, size, _ in sizes:
            self._count(str(session), -int(size))
        return sum(int(count) for _, _, count in sizes)

    def use(self, tinker_session: str, sequence_ids: Sequence[str]) -> dict[str, Record]:
        """The live records of `tinker_session` among `sequence_ids`, each one's clock
        restarted. A record of another session, or expired, is absent as if unknown."""
        ids = list(dict.fromkeys(sequence_ids))
        if not ids:
            return {}
        now = self.clock()
        found: dict[str, Record] = {}
        with self._lock:
            for start in range(0, len(ids), 500):
                part = ids[start : start + 500]
                marks = ", ".join("?" for _ in part)
                rows = self._db.execute(
                    f"SELECT * FROM records WHERE sequence_id IN ({marks}) "
                    "AND tinker_session = ? AND last_used_at >= ?",
                    (*part, tinker_session, now - self.ttl_s),
                ).fetchall()
                for row in rows:
                    found[row["sequence_id"]] = _record(row)
            if found:
                marks = ", ".join("?" for _ in found)
                self._db.execute(
                    f"UPDATE records SET last_used_at = ? WHERE sequence_id IN ({marks})",
                    (now, *found),
                )
        return found


def _record(row: sqlite3.Row) -> Record:
    return Record(
        sequence_id=row["sequence_id"],
        tinker_session=row["tinker_session"],
        prompt=np.frombuffer(row["prompt"], dtype="<i4").astype(np.int64),
        tokens=np.frombuffer(row["tokens"], dtype="<i4").astype(np.int64),
        logprobs=np.frombuffer(row["logprobs"], dtype="<f4").astype(np.float32),
        version=int(row["version"]),
    )


def records_of_sample(
    tinker_session: str, request_id: str, prompt: Sequence[int], output: Mapping[str, Any]
) -> list[Record]:
    """The records of one sample's sequences (the engine's sample output for one prompt),
    named `<request_id>:<i>` as `asample` announced them."""
    (group,) = output["results"]
    versions = [int(s["version"]) for s in group.get("policy_segments", [])]
    prompt_ids = np.asarray(prompt, dtype=np.int64)
    return [
        Record(
            sequence_id=f"{request_id}:{i}",
            tinker_session=tinker_session,
            prompt=prompt_ids,
            tokens=np.asarray(seq["tokens"], dtype=np.int64),
            logprobs=np.asarray(seq["logprobs"], dtype=np.float32),
            version=max(versions, default=0),
        )
        for i, seq in enumerate(group["sequences"])
    ]


# --------------------------------------------------------------------------------------------
# Provenance
# --------------------------------------------------------------------------------------------


def parse_spans(raw: Any, field: str, length: int, max_spans: int) -> tuple[Span, ...]:
    """A datum's span list, checked to tile `length` positions, as `Span`s."""
    if raw is None:
        raise TinkerInputError(field, "is required by stable_reinforce (Datum.with_provenance)")
    if not isinstance(raw, list):
        raise TinkerInputError(field, "must be a list of provenance spans")
    if len(raw) > max_spans:
        raise TinkerInputError(field, f"has {len(raw)} spans, more than {max_spans}")
    spans = []
    for j, item in enumerate(raw):
        where = f"{field}[{j}]"
        arms = [k for k in (PROMPT, SAMPLED) if isinstance(item, Mapping) and k in item]
        if not isinstance(item, Mapping) or len(arms) != 1 or len(item) != 1:
            raise TinkerInputError(where, f"must be {{{PROMPT!r}: ...}} or {{{SAMPLED!r}: ...}}")
        (kind,) = arms
        body = item[kind]
        if not isinstance(body, Mapping):
            raise TinkerInputError(f"{where}.{kind}", "must be an object")
        for key in body:
            if key not in ("sequence_id", "offset", "length"):
                raise TinkerInputError(f"{where}.{kind}.{key}", "is not a span field")
        sequence_id = body.get("sequence_id")
        if not isinstance(sequence_id, str) or not sequence_id or len(sequence_id) > 256:
            raise TinkerInputError(
                f"{where}.{kind}.sequence_id", "must be a sequence_id (a non-empty string)"
            )
        numbers = []
        for key in ("offset", "length"):
            value = body.get(key, 0)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise TinkerInputError(f"{where}.{kind}.{key}", "must be an integer >= 0")
            numbers.append(value)
        spans.append(Span(kind, sequence_id, numbers[0], numbers[1]))
    covered = sum(s.length for s in spans)
    if covered != length:
        raise TinkerInputError(
            field, f"spans cover {covered} positions, but the field has {length}; they must tile it"
        )
    return tuple(spans)


def resolve(
    store: StabilityRecords,
    tinker_session: str,
    body: dict[str, Any],
    provenance: Sequence[Provenance],
    where: str,
) -> dict[str, Any]:
    """`body` (a forward-backward body of `LOSS_TYPE_STABLE_REINFORCE`) with each sample's
    `logprobs` the recorded ones under its sampled target spans and its `mask` those
    positions, after checking every span against its record (a `TinkerInputError` naming
    the field, `where` the datums' path)."""
    ids = [s.sequence_id for p in provenance for s in (*p.model_input, *p.targets)]
    records = store.use(tinker_session, ids)
    for i, (sample, spans) in enumerate(zip(body["samples"], provenance, strict=True)):
        datum = f"{where}[{i}]"
        tokens = np.asarray(sample["model_input"]["chunks"][0]["encoded_text"]["tokens"])
        inputs = sample["loss_fn_inputs"]
        _check_tokens(tokens, spans.model_input, records, f"{datum}.model_input_spans")
        targets = np.asarray(inputs["target_tokens"]["data"], dtype=np.int64)
        advantages = np.asarray(inputs["advantages"]["data"], dtype=np.float64)
        q = np.zeros(len(targets), dtype=np.float32)
        keep = np.zeros(len(targets), dtype=np.float32)
        field = f"{datum}.loss_fn_input_spans"
        start = 0
        for j, span in enumerate(spans.targets):
            stop = start + span.length
            record = _record_of(records, span, f"{field}[{j}]")
            if span.kind == SAMPLED:
                _check_run(targets[start:stop], record.tokens, span, f"{field}[{j}]", "target")
                q[start:stop] = record.logprobs[span.offset : span.offset + span.length]
                keep[start:stop] = 1.0
            else:  # a prompt run carries no loss (its targets need not be sent: 0 is fine)
                _check_range(record.prompt, span, f"{field}[{j}]")
                nonzero = np.flatnonzero(advantages[start:stop] != 0)
                if nonzero.size:
                    raise TinkerInputError(
                        f"{datum}.loss_fn_inputs.advantages",
                        f"is non-zero at position {start + int(nonzero[0])}, which prompt span "
                        f"loss_fn_input_spans[{j}] covers; stable_reinforce trains sampled "
                        "tokens only",
                    )
            start = stop
        if "mask" in inputs:
            keep *= (np.asarray(inputs["mask"]["data"]) != 0).astype(np.float32)
        inputs["logprobs"] = {"data": q.tolist(), "dtype": "float32"}
        inputs["mask"] = {"data": keep.tolist(), "dtype": "float32"}
    return body


def _record_of(records: Mapping[str, Record], span: Span, where: str) -> Record:
    record = records.get(span.sequence_id)
    if record is None:
        raise TinkerInputError(f"{where}.sequence_id", f"{span.sequence_id!r} {UNKNOWN}")
    return record


def _check_range(recorded: np.ndarray, span: Span, where: str) -> None:
    if span.offset + span.length > len(recorded):
        part = "prompt" if span.kind == PROMPT else "sampled tokens"
        raise TinkerInputError(
            where,
            f"[{span.offset}, {span.offset + span.length}) runs past the recorded {part} of "
            f"{span.sequence_id!r} ({len(recorded)} tokens)",
        )


def _check_run(got: np.ndarray, recorded: np.ndarray, span: Span, where: str, what: str) -> None:
    """The datum's tokens under `span` are the record's."""
    _check_range(recorded, span, where)
    want = recorded[span.offset : span.offset + span.length]
    differ = np.flatnonzero(got != want)
    if differ.size:
        k = int(differ[0])
        raise TinkerInputError(
            where,
            f"{what} token {int(got[k])} at run position {k} differs from the recorded "
            f"{int(want[k])} of {span.sequence_id!r} (position {span.offset + k} of its "
            f"{'prompt' if span.kind == PROMPT else 'sampled tokens'})",
        )


def _check_tokens(
    tokens: np.ndarray, spans: Sequence[Span], records: Mapping[str, Record], field: str
) -> None:
    start = 0
    for j, span in enumerate(spans):
        record = _record_of(records, span, f"{field}[{j}]")
        recorded = record.prompt if span.kind == PROMPT else record.tokens
        _check_run(tokens[start : start + span.length], recorded, span, f"{field}[{j}]", "input")
        start += span.length
