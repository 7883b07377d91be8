"""Who is calling: API keys, the users they belong to, and those users' quotas.

`trainer serve --keys FILE` reads a TOML file of `[[key]]` entries:

    [[key]]
    user = "alice"            # the user id: created_by, owners, audit, metrics
    sha256 = "9f86d08..."     # hex sha256 of the key; keys are never stored in clear
    admin = false             # an admin sees and manages every user's work
    [key.quotas]              # optional; an absent quota is unlimited
    max_resources = 2
    max_sessions = 8
    max_storage_bytes = 20_000_000_000

A user may have several keys (one entry each; the user's quotas and admin flag must agree
across them). The same key works on both faces. `KeyRing.reload` (SIGHUP) reads the file again:
a revoked key is refused from the next request on; a malformed file keeps the keys in force and
says why. Without a keys file the worker's single token stands for one user, `local`, an admin.

A key is identified by its sha256, compared with every entry in constant time
(`hmac.compare_digest`), so neither the key nor how much of it matched shows in the timing.
Keys and their digests are never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import threading
from pathlib import Path
from typing import Any

import tomllib

from trainer.serving.tenants import LOCAL, LOCAL_USER, Principal, Quotas

log = logging.getLogger(__name__)

__all__ = ["LOCAL", "LOCAL_USER", "KeyRing", "KeysFileError", "Principal", "Quotas", "parse_keys"]

USER_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
QUOTA_NAMES = ("max_resources", "max_sessions", "max_storage_bytes")


class KeysFileError(ValueError):
    """A keys file that cannot be served, with the line it went wrong at."""


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class KeyRing:
    """The keys in force: from a keys file (`path`), else the single `token` (user `local`,
    admin), else none at all (`--no-auth`: every request is `local`)."""

    def __init__(self, path: Path | None = None, token: str | None = None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._entries: list[tuple[bytes, Principal]] = []
        if path is not None:
            self._entries = parse_keys(path.read_text(), str(path))
        elif token is not None:
            self._entries = [(digest(token), LOCAL)]
        self.open = path is None and token is None

    def reload(self) -> bool:
        """Read the keys file again (SIGHUP). A malformed file keeps the keys in force."""
        if self.path is None:
            return False
        try:
            entries = parse_keys(self.path.read_text(), str(self.path))
        except (OSError, KeysFileError) as exc:
            log.error("keys file not reloaded, the keys in force stay: %s", exc)
            return False
        with self._lock:
            self._entries = entries
        log.info("keys file reloaded: %d keys of %d users", len(entries), len(self.users()))
        return True

    def identify(self, key: str) -> Principal | None:
        """The principal of `key`, or None. Every entry is compared, in constant time each."""
        if self.open:
            return LOCAL
        given = digest(key)
        with self._lock:
            entries = list(self._entries)
        found: Principal | None = None
        for known, principal in entries:
            if hmac.compare_digest(given, known) and found is None:
                found = principal
        return found

    def users(self) -> dict[str, Principal]:
        with self._lock:
            return {p.user: p for _, p in self._entries} or {LOCAL_USER: LOCAL}

    def principal(self, user: str) -> Principal | None:
        return self.users().get(user)


def _key_lines(text: str) -> list[int]:
    """The 1-based line of each `[[key]]` header, in order."""
    return [
        number
        for number, line in enumerate(text.splitlines(), start=1)
        if re.match(r"\s*\[\[\s*key\s*\]\]", line)
    ]


def parse_keys(text: str, source: str = "keys file") -> list[tuple[bytes, Principal]]:
    """The (sha256 digest, principal) of each `[[key]]` of a keys file; a `KeysFileError`
    naming the line of the first problem."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise KeysFileError(f"{source}: {exc}") from None
    lines = _key_lines(text)
    for name in data:
        if name != "key":
            raise KeysFileError(f"{source}: {name!r} is not a table of a keys file (only [[key]])")
    raw = data.get("key", [])
    if not isinstance(raw, list) or not raw:
        raise KeysFileError(f"{source}: no [[key]] entries")
    entries: list[tuple[bytes, Principal]] = []
    seen: dict[bytes, int] = {}
    users: dict[str, tuple[Principal, int]] = {}
    for index, item in enumerate(raw):
        line = lines[index] if index < len(lines) else 0
        where = f"{source}, line {line} ([[key]] #{index + 1})"
        principal, sha = _entry(item, where)
        if sha in seen:
            raise KeysFileError(f"{where}: the same sha256 as the [[key]] at line {seen[sha]}")
        seen[sha] = line
        earlier = users.get(principal.user)
        if earlier is not None and earlier[0] != principal:
            raise KeysFileError(
                f"{where}: user {principal.user!r} has other admin or quotas at line "
                f"{earlier[1]}; a user's keys must agree"
            )
        users.setdefault(principal.user, (principal, line))
        entries.append((sha, principal))
    return entries


def _entry(item: Any, where: str) -> tuple[Principal, bytes]:
    if not isinstance(item, dict):
        raise KeysFileError(f"{where}: must be a table")
    for name in item:
        if name not in ("user", "sha256", "admin", "quotas"):
            raise KeysFileError(f"{where}: {name!r} is not a key field")
    user = item.get("user")
    if not isinstance(user, str) or not USER_PATTERN.fullmatch(user):
        raise KeysFileError(
            f"{where}: user must be 1-64 letters, digits, '_', '.', '@' or '-', got {user!r}"
        )
    sha = item.get("sha256")
    if not isinstance(sha, str) or not _HEX64.fullmatch(sha.lower()):
        raise KeysFileError(f"{where}: sha256 must be 64 hex digits (sha256 of the key)")
    admin = item.get("admin", False)
    if not isinstance(admin, bool):
        raise KeysFileError(f"{where}: admin must be true or false")
    quotas = item.get("quotas", {})
    if not isinstance(quotas, dict):
        raise KeysFileError(f"{where}: quotas must be a table")
    limits: dict[str, int] = {}
    for name, value in quotas.items():
        if name not in QUOTA_NAMES:
            raise KeysFileError(f"{where}: quotas.{name} is not a quota (one of {QUOTA_NAMES})")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise KeysFileError(f"{where}: quotas.{name} must be an integer >= 0")
        limits[name] = value
    return Principal(user, admin, Quotas(**limits)), bytes.fromhex(sha.lower())
