"""The stability records of `stable_reinforce` (docs/semantics.md §13): kept per Tinker session,
expiring a day after their last use, within a byte budget (least recently used dropped first),
and still there after a restart (the store reopened from its file)."""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import pytest

from trainer.api.tinker.convert_inputs import TinkerInputError
from trainer.api.tinker.stability import (
    Provenance,
    Record,
    Span,
    StabilityRecords,
    parse_spans,
    records_of_sample,
    resolve,
)

DAY = 86400.0


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def record(sequence_id: str, session: str = "s1", n: int = 4) -> Record:
    rng = np.random.default_rng(zlib.crc32(sequence_id.encode()))
    return Record(
        sequence_id=sequence_id,
        tinker_session=session,
        prompt=np.arange(3, dtype=np.int64),
        tokens=rng.integers(0, 50, n),
        logprobs=-rng.random(n).astype(np.float32),
        version=2,
    )


def store(tmp_path: Path, clock: Clock, max_bytes: int = 1 << 20) -> StabilityRecords:
    return StabilityRecords(tmp_path / "stability.sqlite", DAY, max_bytes, clock)


def test_a_record_round_trips_exactly_and_survives_a_restart(tmp_path: Path) -> None:
    clock = Clock()
    rec = record("req_a:0")
    records = store(tmp_path, clock)
    records.put([rec])
    size = records.bytes
    records.close()
    again = store(tmp_path, clock)
    assert again.bytes == size > 0
    got = again.use("s1", ["req_a:0"])["req_a:0"]
    assert got.logprobs.dtype == np.float32 and np.array_equal(got.logprobs, rec.logprobs)
    assert np.array_equal(got.tokens, rec.tokens) and np.array_equal(got.prompt, rec.prompt)
    assert (got.version, got.tinker_session) == (2, "s1")


def test_records_belong_to_their_session(tmp_path: Path) -> None:
    records = store(tmp_path, Clock())
    records.put([record("req_a:0", "s1"), record("req_b:0", "s2")])
    assert set(records.use("s1", ["req_a:0", "req_b:0", "req_c:0"])) == {"req_a:0"}
    assert set(records.use("s2", ["req_a:0", "req_b:0"])) == {"req_b:0"}


def test_a_record_expires_a_day_after_its_last_use(tmp_path: Path) -> None:
    clock = Clock()
    records = store(tmp_path, clock)
    records.put([record("req_a:0"), record("req_b:0")])
    clock.now += DAY - 10
    assert set(records.use("s1", ["req_a:0"])) == {"req_a:0"}  # restarts a's day
    clock.now += 20  # b is a day and 10 s old, a 20 s since its use
    assert set(records.use("s1", ["req_a:0", "req_b:0"])) == {"req_a:0"}
    assert records.expire() == 1 and len(records) == 1
    clock.now += DAY + 1
    assert records.use("s1", ["req_a:0"]) == {}
    assert records.expire() == 1 and len(records) == 0 and records.bytes == 0


def test_the_byte_budget_drops_the_least_recently_used(tmp_path: Path) -> None:
    clock = Clock()
    one = store(tmp_path / "probe", clock)
    one.put([record("req_0:0")])
    size = one.bytes
    records = store(tmp_path, clock, max_bytes=3 * size)
    for i in range(3):
        clock.now += 1
        records.put([record(f"req_{i}:0")])
    clock.now += 1
    records.use("s1", ["req_0:0"])  # the oldest put is now the most recently used
    clock.now += 1
    records.put([record("req_3:0")])
    assert records.bytes <= 3 * size
    assert set(records.use("s1", [f"req_{i}:0" for i in range(4)])) == {
        "req_0:0",
        "req_2:0",
        "req_3:0",
    }


def test_records_of_a_sample_are_named_as_asample_announced() -> None:
    output = {
        "results": [
            {
                "sequences": [
                    {"tokens": [4, 5], "logprobs": [-0.25, -1.5]},
                    {"tokens": [6], "logprobs": [-0.125]},
                ],
                "policy_segments": [{"start_token": 0, "version": 7}],
            }
        ]
    }
    got = records_of_sample("s1", "req_x", [1, 2, 3], output)
    assert [r.sequence_id for r in got] == ["req_x:0", "req_x:1"]
    assert [r.version for r in got] == [7, 7]
    assert got[1].logprobs.tolist() == [-0.125] and got[0].prompt.tolist() == [1, 2, 3]


def spans(*runs: tuple[str, str, int, int]) -> list[dict]:
    return [{kind: {"sequence_id": s, "offset": o, "length": n}} for kind, s, o, n in runs]


@pytest.mark.parametrize(
    ("raw", "field", "message"),
    [
        (None, "f", "is required"),
        ("x", "f", "must be a list"),
        ([{"prompt_tokens": {}, "sampled_tokens": {}}], "f[0]", "must be"),
        (
            [{"prompt_tokens": {"sequence_id": "", "length": 4}}],
            "f[0].prompt_tokens.sequence_id",
            "",
        ),
        (
            [{"sampled_tokens": {"sequence_id": "a", "length": -1}}],
            "f[0].sampled_tokens.length",
            "",
        ),
        (
            [{"sampled_tokens": {"sequence_id": "a", "length": 4, "x": 1}}],
            "f[0].sampled_tokens.x",
            "",
        ),
        (spans(("sampled_tokens", "a", 0, 3)), "f", "cover 3 positions"),
    ],
)
def test_span_lists_are_checked(raw: object, field: str, message: str) -> None:
    with pytest.raises(TinkerInputError) as info:
        parse_spans(raw, "f", 4, 10)
    assert info.value.field == field and message in str(info.value)


def test_resolve_takes_the_recorded_logprobs_not_the_datums(tmp_path: Path) -> None:
    records = store(tmp_path, Clock())
    rec = record("req_a:0", n=3)
    records.put([rec])
    tokens = [*rec.prompt.tolist(), *rec.tokens[:-1].tolist()]  # 3 + 2
    targets = [0, 0, *rec.tokens.tolist()]
    body = {
        "samples": [
            {
                "model_input": {"chunks": [{"encoded_text": {"tokens": tokens}}]},
                "loss_fn_inputs": {
                    "target_tokens": {"data": targets, "dtype": "int64"},
                    "advantages": {"data": [0, 0, 1, 1, 1], "dtype": "float32"},
                    "logprobs": {"data": [9.0] * 5, "dtype": "float32"},
                },
            }
        ]
    }
    provenance = Provenance(
        (Span("prompt_tokens", "req_a:0", 0, 3), Span("sampled_tokens", "req_a:0", 0, 2)),
        (Span("prompt_tokens", "req_a:0", 1, 2), Span("sampled_tokens", "req_a:0", 0, 3)),
    )
    out = resolve(records, "s1", body, [provenance], "data")
    inputs = out["samples"][0]["loss_fn_inputs"]
    assert inputs["logprobs"]["data"] == [0.0, 0.0, *rec.logprobs.tolist()]
    assert inputs["mask"]["data"] == [0.0, 0.0, 1.0, 1.0, 1.0]
    with pytest.raises(TinkerInputError) as info:
        resolve(records, "s2", body, [provenance], "data")
    assert info.value.field == "data[0].model_input_spans[0].sequence_id"


def test_a_flooding_session_drops_only_its_own_records(tmp_path: Path) -> None:
    """One tenant never hurts another: a session recording far past the budget loses its own
    oldest records; a neighbour within its share keeps every one."""
    clock = Clock()
    probe = store(tmp_path / "probe", clock)
    probe.put([record("req_00_0:0", "flood")])
    size = probe.bytes  # of each flooding record
    records = store(tmp_path, clock, max_bytes=10 * size)
    neighbour = [f"req_n{i}:0" for i in range(4)]
    records.put([record(sid, "quiet") for sid in neighbour])
    for batch in range(50):  # 500 records, 50 budgets' worth
        clock.now += 1
        records.put([record(f"req_{batch:02d}_{i}:0", "flood") for i in range(10)])
    assert set(records.use("quiet", neighbour)) == set(neighbour)
    assert records.session_bytes("flood") <= records.share() == 5 * size
    assert records.bytes <= 10 * size
    newest = [f"req_49_{i}:0" for i in range(10)]
    assert len(records.use("flood", newest)) == 5  # it keeps its most recent share
