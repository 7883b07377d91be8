"""Keys files for tests with several users: random keys, stored by their sha256 only."""

from __future__ import annotations

import hashlib
import secrets
from pathlib import Path

from trainer.api.keys import KeyRing


def write_keys(path: Path, admins: tuple[str, ...], users: tuple[str, ...]) -> dict[str, str]:
    """Write a keys file with one fresh key per user; return user -> key (in clear)."""
    keys: dict[str, str] = {}
    entries = []
    for user in (*admins, *users):
        key = f"key-{user}-{secrets.token_hex(16)}"
        keys[user] = key
        sha = hashlib.sha256(key.encode()).hexdigest()
        admin = "true" if user in admins else "false"
        entries.append(f'[[key]]\nuser = "{user}"\nsha256 = "{sha}"\nadmin = {admin}\n')
    path.write_text("\n".join(entries))
    return keys


def team(tmp: Path) -> tuple[KeyRing, dict[str, str]]:
    """An admin `root` and two users, `alice` and `bob`."""
    keys = write_keys(tmp / "keys.toml", ("root",), ("alice", "bob"))
    return KeyRing(tmp / "keys.toml"), keys
