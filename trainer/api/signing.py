"""Signed, expiring URLs for the routes the SDK calls without an Authorization header.

The SDK fetches checkpoint files and uploads/downloads large payloads at "presigned" URLs it
treats as opaque. The worker serves them itself: the query string carries `expires` (epoch
seconds), `user` (the user it was issued to, who owns the object) and `sig` =
HMAC-SHA256(secret, "METHOD\\npath\\nexpires\\nuser"), so a URL only works for the method and
path it was issued for, on behalf of that user, and only until it expires. The route checks
that the user still owns the object (`trainer.serving.ownership`) and the audit trail names
the user. (URLs signed without a user, before users were recorded, still verify as they were.)

The secret lives in `<storage>/signing.key` (created once, mode 0600), so URLs stay valid
across restarts until they expire.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import stat
import time
import uuid
from pathlib import Path
from urllib.parse import quote, urlencode

log = logging.getLogger(__name__)

KEY_FILE = "signing.key"
_KEY_BYTES = 32
_EXPIRES = re.compile(r"[0-9]{1,20}", re.ASCII)  # epoch seconds; 20 digits hold any uint64
_SIG = re.compile(r"[0-9a-f]{64}", re.ASCII)  # hex HMAC-SHA256
_USER = re.compile(r"[A-Za-z0-9_.@-]{1,64}", re.ASCII)  # a user id (`keys.USER_PATTERN`)


def _read_key(path: Path) -> bytes | None:
    """The secret in `path` (hex), or None when the file holds no valid key."""
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        log.warning("%s was readable by others (mode %o); setting it to 0600", path, mode)
        os.chmod(path, 0o600)
    try:
        secret = bytes.fromhex(path.read_text().strip())
    except (ValueError, UnicodeDecodeError):
        return None
    return secret if len(secret) >= _KEY_BYTES else None


def load_or_create_key(path: Path) -> bytes:
    """The signing secret kept at `path`: read it, or create it once (0600, atomically: a
    concurrent start or a crash mid-write never leaves a partial key)."""
    if path.exists():
        existing = _read_key(path)
        if existing is not None:
            return existing
        log.warning("%s holds no valid key; replacing it (URLs signed before are void)", path)
    secret = secrets.token_bytes(_KEY_BYTES)
    partial = path.with_name(f".{path.name}.{uuid.uuid4().hex}.part")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as handle:
            os.fchmod(handle.fileno(), 0o600)
            handle.write(secret.hex())
            handle.flush()
            os.fsync(handle.fileno())
        if path.exists():  # the invalid key found above
            os.replace(partial, path)
        else:
            try:
                os.link(partial, path)  # create-if-absent: a concurrent start keeps one key
            except FileExistsError:
                return load_or_create_key(path)
    finally:
        partial.unlink(missing_ok=True)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return secret


class UrlSigner:
    def __init__(self, secret: bytes | None = None, ttl_s: float = 3600.0) -> None:
        self._secret = secret if secret is not None else secrets.token_bytes(_KEY_BYTES)
        self.ttl_s = ttl_s

    @classmethod
    def for_storage(cls, storage: Path, ttl_s: float) -> UrlSigner:
        """A signer whose secret persists in `storage/signing.key`."""
        return cls(load_or_create_key(storage / KEY_FILE), ttl_s)

    def _mac(self, method: str, path: str, expires: int, user: str | None = None) -> str:
        message = f"{method.upper()}\n{path}\n{expires}"
        if user is not None:
            message += f"\n{user}"
        return hmac.new(self._secret, message.encode(), hashlib.sha256).hexdigest()

    def sign(
        self,
        base_url: str,
        method: str,
        path: str,
        now: float | None = None,
        user: str | None = None,
    ) -> str:
        """Absolute URL for the (decoded) `path`, valid for `ttl_s` seconds, issued to `user`."""
        expires = int((time.time() if now is None else now) + self.ttl_s)
        fields: dict[str, str | int] = {"expires": expires}
        if user is not None:
            fields["user"] = user
        fields["sig"] = self._mac(method, path, expires, user)
        return f"{base_url.rstrip('/')}{quote(path, safe='/')}?{urlencode(fields)}"

    def verify(
        self,
        method: str,
        path: str,
        expires: str | None,
        sig: str | None,
        now: float | None = None,
        user: str | None = None,
    ) -> str | None:
        """None when valid, else the reason the URL is refused (see `refused_param`).

        `expires`, `sig` and `user` are whatever the client sent: only ASCII digits (at most
        20), 64 lowercase hex digits and a user id get as far as `int()` and the constant-time
        comparison.
        """
        if not expires or not sig:
            return "missing signature"
        if not _EXPIRES.fullmatch(expires):
            return "malformed expiry"
        if int(expires) < (time.time() if now is None else now):
            return "URL expired"
        if not _SIG.fullmatch(sig) or (user is not None and not _USER.fullmatch(user)):
            return "bad signature"
        if not hmac.compare_digest(self._mac(method, path, int(expires), user), sig):
            return "bad signature"
        return None


def refused_param(reason: str) -> str:
    """The query parameter a `verify` reason is about."""
    return "expires" if reason in ("malformed expiry", "URL expired") else "sig"


_SIG_IN_URL = re.compile(r"([?&]sig=)[0-9A-Fa-f]+")


def redact(text: str) -> str:
    """`...?expires=E&sig=HEX` -> `...?expires=E&sig=<redacted>`."""
    return _SIG_IN_URL.sub(r"\1<redacted>", text)


class RedactSignatures(logging.Filter):
    """Keeps live signatures out of access logs: a logged signed URL would be a credential."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(redact(a) if isinstance(a, str) else a for a in record.args)
        return True
