"""Routing-replay keys at scale (`trainer.engine.moe_replay_keys.ReplayKeys`): a put or a lookup
costs the same with 1 k or 25 k live keys, and each session's keys live within its own share of
the byte budget, so one session's keys never evict another's."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from trainer.engine.moe_replay_keys import SHARE_FLOOR, ReplayKeys, UnknownKey

ROUTES = torch.zeros((3, 1, 1), dtype=torch.int16)
TOKENS = [1, 2, 3, 4]
CALL = 256  # sequences of one keyed sample call


def _size(tmp_path: Path, session: str) -> int:
    """Bytes of one key file of `session` (its id is in the file's header)."""
    probe = ReplayKeys(tmp_path / "probe")
    key = probe.put(session, TOKENS, ROUTES)
    return (tmp_path / "probe" / "routes" / f"{key}.safetensors").stat().st_size


def _fill(store: ReplayKeys, session: str, count: int) -> list[str]:
    return [store.put(session, TOKENS, ROUTES) for _ in range(count)]


def _call_cost(store: ReplayKeys, session: str) -> float:
    """Seconds of one keyed sample call and its replay (256 puts, then 256 lookups): the best
    of three, so a neighbour's burst on the CPU does not count."""
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        keys = _fill(store, session, CALL)
        for key in keys:
            store.get(key)
        best = min(best, time.perf_counter() - started)
    return best


def test_put_and_lookup_cost_stays_flat_from_1k_to_25k_keys(tmp_path: Path) -> None:
    size = _size(tmp_path, "a")
    store = ReplayKeys(tmp_path, ttl_s=1e9)
    _fill(store, "a", 1_000)
    store.max_bytes = store.session_bytes("a")  # full: every put now evicts the oldest key
    small = _call_cost(store, "a")
    assert len(store) == 1_000
    store.max_bytes = 1 << 40
    _fill(store, "a", 24_000)
    store.max_bytes = store.session_bytes("a")
    large = _call_cost(store, "a")
    assert len(store) == 25_000 and store.session_bytes("a") > 24_000 * size
    assert large < 3 * small, (small, large)  # linear in the keys would be about 25 x


def test_a_session_filling_its_share_never_evicts_another_sessions_key(tmp_path: Path) -> None:
    size = _size(tmp_path, "hog")
    store = ReplayKeys(tmp_path, max_bytes=64 * size)
    others = {f"s{i}": _fill(store, f"s{i}", 3) for i in range(3)}
    # the hog fills its share many times over while another session keeps writing its own
    late: list[str] = []
    hog = threading.Thread(target=_fill, args=(store, "hog", 3_000))
    hog.start()
    while hog.is_alive() and len(late) < 10:
        late.append(store.put("late", TOKENS, ROUTES))
    hog.join()
    others["late"] = late
    for session, keys in others.items():
        assert all(store.get(key)[0] == session for key in keys), session
    share = store.share()
    assert share == 64 * size // 5  # the budget split between the five sessions with keys
    assert store.session_bytes("hog") <= share
    # a restart rebuilds each session's share from the files: the hog still evicts only its own
    again = ReplayKeys(tmp_path, max_bytes=64 * size)
    hog_keys = _fill(again, "hog", 200)
    for session, keys in others.items():
        assert all(again.get(key)[0] == session for key in keys), session
    assert again.session_bytes("hog") <= again.share()
    with pytest.raises(UnknownKey):
        again.get(hog_keys[0])  # its own oldest went first
    assert again.get(hog_keys[-1])[0] == "hog"


def test_many_sessions_keep_at_least_the_floor_share(tmp_path: Path) -> None:
    size = _size(tmp_path, "s00")
    store = ReplayKeys(tmp_path, max_bytes=SHARE_FLOOR * 4 * size)
    sessions = [f"s{i:02d}" for i in range(4 * SHARE_FLOOR)]
    kept: dict[str, list[str]] = {session: [] for session in sessions}
    for _ in range(6):  # in turns: a session over a share that shrank fits at its next put
        for session in sessions:
            kept[session].append(store.put(session, TOKENS, ROUTES))
    assert store.share() == 4 * size  # max_bytes // SHARE_FLOOR, not max_bytes / 64 sessions
    for session in sessions:
        assert 3 * size < store.session_bytes(session) <= 4 * size  # sizes vary by a few bytes
        assert [store.get(key)[0] for key in kept[session][-3:]] == [session] * 3
        with pytest.raises(UnknownKey):
            store.get(kept[session][0])


def test_expiry_drops_from_the_oldest_end(tmp_path: Path) -> None:
    clock = [0.0]
    store = ReplayKeys(tmp_path, ttl_s=10.0, clock=lambda: clock[0])
    old = _fill(store, "a", 50) + _fill(store, "b", 50)
    clock[0] = 11.0
    fresh = store.put("c", TOKENS, ROUTES)  # expires every older key on its way in
    assert len(store) == 1 and store.session_bytes("a") == store.session_bytes("b") == 0
    assert not any((tmp_path / "routes" / f"{key}.safetensors").exists() for key in old)
    assert store.get(fresh)[0] == "c"
