"""Signed, expiring URLs for the routes the SDK calls without an Authorization header.

The SDK fetches checkpoint files and uploads/downloads large payloads at "presigned" URLs it
treats as opaque. The worker serves them itself: the query string carries `expires` (epoch
seconds) and `sig` = HMAC-SHA256(secret, "METHOD\\npath\\nexpires"), so a URL only works for
the method and path it was issued for, and only until it expires.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
import time
from urllib.parse import quote, urlencode


class UrlSigner:
    def __init__(self, secret: bytes | None = None, ttl_s: float = 3600.0) -> None:
        self._secret = secret if secret is not None else secrets.token_bytes(32)
        self.ttl_s = ttl_s

    def _mac(self, method: str, path: str, expires: int) -> str:
        message = f"{method.upper()}\n{path}\n{expires}".encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def sign(self, base_url: str, method: str, path: str, now: float | None = None) -> str:
        """Absolute URL for the (decoded) `path`, valid for `ttl_s` seconds."""
        expires = int((time.time() if now is None else now) + self.ttl_s)
        query = urlencode({"expires": expires, "sig": self._mac(method, path, expires)})
        return f"{base_url.rstrip('/')}{quote(path, safe='/')}?{query}"

    def verify(
        self, method: str, path: str, expires: str | None, sig: str | None, now: float | None = None
    ) -> str | None:
        """None when valid, else the reason the URL is refused."""
        if not expires or not sig:
            return "missing signature"
        if not expires.isdigit():
            return "malformed expiry"
        if int(expires) < (time.time() if now is None else now):
            return "URL expired"
        if not hmac.compare_digest(self._mac(method, path, int(expires)), sig):
            return "bad signature"
        return None


_SIG = re.compile(r"([?&]sig=)[0-9A-Fa-f]+")


def redact(text: str) -> str:
    """`...?expires=E&sig=HEX` -> `...?expires=E&sig=<redacted>`."""
    return _SIG.sub(r"\1<redacted>", text)


class RedactSignatures(logging.Filter):
    """Keeps live signatures out of access logs: a logged signed URL would be a credential."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(redact(a) if isinstance(a, str) else a for a in record.args)
        return True
