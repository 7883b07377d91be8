"""Routing-replay keys (docs/semantics.md §12): where recorded routes live, and how a session's
samples issue and use them. A sample may carry its routes inline instead of a key
(`routing_matrices`, the Fireworks SDK's R3): both become the prepared sample's
`routed_experts`, which the one replay path (`compute/moe_replay.replaying`) forces.

Design notes: `docs/design/engine.md`.
"""

from __future__ import annotations

import os
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from trainer.compute.moe_replay import expert_count, routing_shape
from trainer.contract.errors import OperationError, invalid
from trainer.contract.options import ROUTES_MAX_BYTES, ROUTES_TTL_S
from trainer.contract.routing import decode

KEY_PATTERN = re.compile(r"re-[0-9a-f]{32}")
UNKNOWN_KEY = "unknown key (never issued to this session, or dropped by the byte budget)"
FIELD = "routed_experts_key"
INLINE = "routing_matrices"


class UnknownKey(LookupError):
    """The key is malformed, unknown or expired."""


SHARE_FLOOR = 16
"""A session's share of the byte budget is never below `max_bytes // SHARE_FLOOR`."""


@dataclass
class _Key:
    created: float
    size: int
    owner: str


class ReplayKeys:
    """The key files under one storage root. Thread-safe; `clock` is for tests.

    Every put and lookup costs O(1) in the number of keys (amortised): `_keys` lists all keys
    oldest first, so expiry drops from its front; `_owned` lists each session's keys oldest
    first, so a session over its share (`share`) drops its own oldest keys and never another
    session's."""

    def __init__(
        self,
        root: Path,
        ttl_s: float = ROUTES_TTL_S,
        max_bytes: int = ROUTES_MAX_BYTES,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.dir = Path(root) / "routes"
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.clock = clock
        self._lock = threading.Lock()
        self._keys: OrderedDict[str, _Key] = OrderedDict()
        self._owned: dict[str, OrderedDict[str, int]] = {}  # owner -> key -> bytes
        self._bytes: dict[str, int] = {}  # owner -> bytes of its keys
        self._scan()

    def _scan(self) -> None:
        if not self.dir.is_dir():
            return
        found: list[tuple[str, _Key]] = []
        for path in self.dir.iterdir():
            if path.suffix == ".tmp":
                path.unlink(missing_ok=True)  # a write cut short
                continue
            key = path.name.removesuffix(".safetensors")
            if not KEY_PATTERN.fullmatch(key):
                continue
            entry = self._read_entry(key)
            if entry is None:
                path.unlink(missing_ok=True)  # a damaged file: it can serve no replay
            else:
                found.append((key, entry))
        for key, entry in sorted(found, key=lambda item: item[1].created):
            self._add(key, entry)

    def _read_entry(self, key: str) -> _Key | None:
        path = self._path(key)
        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
                created, owner = float(meta["created_at"]), str(meta["session_id"])
            return _Key(created, path.stat().st_size, owner)
        except Exception:  # damaged or half-visible: not a key
            return None

    def _path(self, key: str) -> Path:
        return self.dir / f"{key}.safetensors"

    def _add(self, key: str, entry: _Key) -> None:
        self._keys[key] = entry
        self._owned.setdefault(entry.owner, OrderedDict())[key] = entry.size
        self._bytes[entry.owner] = self._bytes.get(entry.owner, 0) + entry.size

    def _forget(self, key: str) -> None:
        entry = self._keys.pop(key, None)
        if entry is None:
            return
        owned = self._owned[entry.owner]
        del owned[key]
        self._bytes[entry.owner] -= entry.size
        if not owned:  # the session holds no key: it no longer takes a share
            del self._owned[entry.owner], self._bytes[entry.owner]

    def _drop(self, key: str) -> None:
        self._forget(key)
        self._path(key).unlink(missing_ok=True)

    def share(self) -> int:
        """Bytes each session with live keys may hold: the budget split between them, and at
        least `max_bytes // SHARE_FLOOR`."""
        sessions = max(len(self._owned), 1)
        return max(self.max_bytes // sessions, self.max_bytes // SHARE_FLOOR)

    def session_bytes(self, session_id: str) -> int:
        """Bytes of the session's live keys."""
        with self._lock:
            return self._bytes.get(session_id, 0)

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)

    def put(self, session_id: str, tokens: list[int], routes: torch.Tensor) -> str:
        """Store one sequence's routes; returns its new key."""
        key = "re-" + secrets.token_hex(16)
        now = float(self.clock())
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self._path(key)
        tmp = path.with_suffix(".tmp")
        tensors = {
            "tokens": torch.tensor(tokens, dtype=torch.int64),
            "routes": routes.to(torch.int16).contiguous(),
        }
        try:
            save_file(
                tensors, str(tmp), metadata={"session_id": session_id, "created_at": repr(now)}
            )
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        with self._lock:
            self._add(key, _Key(now, path.stat().st_size, session_id))
            self._expire(now, keep=key)
            self._fit(session_id, keep=key)
        return key

    def _expire(self, now: float, keep: str) -> None:
        """Expired keys, from the oldest end (`keep` stays)."""
        while self._keys:
            key, entry = next(iter(self._keys.items()))
            if key == keep or now - entry.created <= self.ttl_s:
                return
            self._drop(key)

    def _fit(self, owner: str, keep: str) -> None:
        """The owner's oldest keys while it holds more than its share (`keep` stays)."""
        share = self.share()
        owned = self._owned[owner]
        while self._bytes[owner] > share:
            oldest = next(iter(owned))
            if oldest == keep:
                return
            self._drop(oldest)

    def get(self, key: str) -> tuple[str, torch.Tensor, torch.Tensor]:
        """(session id, tokens, routes) of a live key; UnknownKey otherwise."""
        if not isinstance(key, str) or not KEY_PATTERN.fullmatch(key):
            raise UnknownKey("not a routed-experts key")
        now = float(self.clock())
        with self._lock:
            entry = self._keys.get(key)
            if entry is None and self._path(key).is_file():  # written by another process
                entry = self._read_entry(key)
                if entry is not None:
                    self._add(key, entry)
            if entry is None:
                raise UnknownKey(UNKNOWN_KEY)
            if now - entry.created > self.ttl_s:
                self._drop(key)
                raise UnknownKey(f"the key expired ({self.ttl_s:g} s after it was issued)")
            path = self._path(key)
            try:
                with safe_open(str(path), "pt") as f:
                    session_id = (f.metadata() or {})["session_id"]
                    return str(session_id), f.get_tensor("tokens"), f.get_tensor("routes")
            except Exception as exc:  # dropped by another process, or damaged
                self._forget(key)
                raise UnknownKey("unknown key") from exc


_STORES: dict[Path, ReplayKeys] = {}
_STORES_LOCK = threading.Lock()


def store_for(session: Any) -> ReplayKeys:
    """The key store under the session's storage root, with its `[engine]` limits."""
    root = Path(str(session.resource.store.root)).resolve()
    with _STORES_LOCK:
        store = _STORES.get(root)
        if store is None:
            store = _STORES[root] = ReplayKeys(root)
    store.ttl_s = float(session.options.routes_ttl_s)
    store.max_bytes = int(session.options.routes_max_bytes)
    return store


def issue_keys(session: Any, prompt: list[int], group: list[Any]) -> list[str | None]:
    """A key per sequence of one prompt's group (None for a sequence without routes). Only
    rank 0 writes (its keys are the ones the client sees; the files are shared)."""
    if session.comm.rank != 0 or all(s.routed_experts is None for s in group):
        return [None] * len(group)
    store = store_for(session)
    return [
        None
        if seq.routed_experts is None
        else store.put(session.id, prompt + seq.tokens, seq.routed_experts)
        for seq in group
    ]


def attach_routed_experts(session: Any, samples: list[Any], prepared: list[Any]) -> None:
    """Each keyed sample's recorded routes, and each sample's inline routes, onto its prepared
    sample (module docstring).

    Under several ranks only rank 0 reads the keys (the other ranks' checkpoint store does not
    know the storage root); every rank then takes rank 0's routes, or its refusal, from one
    exchange, so all fail alike or none. Inline routes are in every rank's body: each decodes
    them alike."""
    for i, s in enumerate(samples):
        if s.routed_experts_key and s.routing_matrices is not None:
            raise invalid(f"samples[{i}].{INLINE}", f"send {FIELD} or {INLINE}, not both")
    inline = [
        (i, s.routing_matrices) for i, s in enumerate(samples) if s.routing_matrices is not None
    ]
    for i, routes in _inline(session, inline, prepared).items():
        prepared[i].routed_experts = routes
    keyed = [(i, s.routed_experts_key) for i, s in enumerate(samples) if s.routed_experts_key]
    if not keyed:
        return
    comm = session.comm
    if comm.world_size == 1:
        found = _resolve(session, keyed, prepared)
    else:
        report: dict[str, Any] = {}
        if comm.rank == 0:
            try:
                mine = _resolve(session, keyed, prepared)
                report = {"routes": {str(i): r.tolist() for i, r in mine.items()}}
            except OperationError as exc:
                report = {"field": exc.field, "message": str(exc)}
        first = comm.all_gather_json(report)[0]
        if "field" in first:
            field = str(first["field"])
            raise invalid(field, str(first["message"]).removeprefix(f"{field}: "))
        found = {int(i): torch.tensor(r, dtype=torch.int16) for i, r in first["routes"].items()}
    for i, routes in found.items():
        prepared[i].routed_experts = routes


def _resolve(
    session: Any, keyed: list[tuple[int, str]], prepared: list[Any]
) -> dict[int, torch.Tensor]:
    shape = routing_shape(session.policy.model)
    store = store_for(session)
    found: dict[int, torch.Tensor] = {}
    for i, key in keyed:
        where = f"samples[{i}].{FIELD}"
        if shape is None:
            raise invalid(where, "this model has no mixture-of-experts layers: no key exists")
        try:
            owner, tokens, routes = store.get(key)
        except UnknownKey as exc:
            raise invalid(where, str(exc)) from None
        if owner != session.id:  # reads as unknown: nothing tells another session's key exists
            raise invalid(where, UNKNOWN_KEY)
        if tuple(routes.shape[1:]) != shape:
            raise invalid(where, "the key was recorded on another model")
        mine = prepared[i].tokens_T
        n = int(mine.shape[0])
        head = n - 1
        if head > routes.shape[0] or not torch.equal(mine[:head], tokens[:head]):
            raise invalid(
                where,
                f"the sample's tokens do not match the recorded sequence over the whole sample "
                f"or all but its final token ({routes.shape[0]} routed positions)",
            )
        last_ok = (
            n <= routes.shape[0] and n <= tokens.shape[0] and int(mine[-1]) == int(tokens[n - 1])
        )
        found[i] = routes[: n if last_ok else head]
    return found


def _inline(
    session: Any, inline: list[tuple[int, list[str]]], prepared: list[Any]
) -> dict[int, torch.Tensor]:
    """Each sample's routing matrices decoded to `[T, layers, k]` ids (int16; -1 rows where a
    matrix is empty: the router's own choice there); samples whose matrices are all empty
    force nothing and are left out. INVALID_INPUT naming the matrix when one is wrong."""
    model = session.policy.model
    shape, experts = routing_shape(model), expert_count(model)
    found: dict[int, torch.Tensor] = {}
    for i, matrices in inline:
        where = f"samples[{i}].{INLINE}"
        n = int(prepared[i].tokens_T.shape[0])
        if len(matrices) != n:
            raise invalid(
                where,
                f"{len(matrices)} matrices for {n} model-input tokens (one per position; an "
                "empty string keeps the router's own choice there)",
            )
        if not any(matrices):
            continue
        if shape is None:
            raise invalid(where, "this model has no mixture-of-experts layers: nothing to replay")
        layers, k = shape
        routes = torch.full((n, layers, k), -1, dtype=torch.int16)
        for j, matrix in enumerate(matrices):
            try:
                ids = decode(matrix, layers, k, experts)
            except ValueError as exc:
                raise invalid(f"{where}[{j}]", str(exc)) from None
            if ids is not None:
                routes[j] = torch.from_numpy(ids)
        found[i] = routes
    return found
