"""HTTP errors in the service's shape: `{"error": {"message", "type", "param", "code"}}`.

Every failure a client can cause is a 4xx with a message that names the offending field
(`param`). Errors are never retried by the official SDK: each carries `x-should-retry: false`
(its client otherwise retries 409 and 429).

A full disk (SQLite's "database or disk is full", or ENOSPC/EDQUOT from a file write) is the
server's condition, not the client's: 507 `insufficient_storage`, from one handler for every
route; the writers clean up their partial files, and the worker serves again once space is
freed.
"""

from __future__ import annotations

import errno
import logging
import re
import sqlite3
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    503: "service_unavailable_error",
    507: "insufficient_storage_error",
}


class ApiError(Exception):
    """An expected failure answered with `status` and the service's error body."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        # a message may echo a client's string; lone surrogates in it cannot go out as UTF-8
        return {
            "error": {
                "message": _utf8(self.message),
                "type": _TYPES.get(self.status, "invalid_request_error"),
                "param": None if self.param is None else _utf8(self.param),
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        headers = {"x-should-retry": "false"}
        if self.status == 401:
            headers["www-authenticate"] = "Bearer"
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def _utf8(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def bad_request(message: str, param: str | None = None, code: str = "invalid_input") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def not_found(kind: str, ident: str, param: str | None = None) -> ApiError:
    prefix = f"{param}: " if param else ""
    shown = repr(ident) if len(ident) <= 200 else f"{ident[:200]!r}... ({len(ident)} characters)"
    return ApiError(404, f"{prefix}{kind} {shown} not found", param=param, code="not_found")


def failed_precondition(message: str, param: str | None = None) -> ApiError:
    """The object is in a state that refuses the request (the hosted service answers 400)."""
    return ApiError(400, message, param=param, code="failed_precondition")


def field_path(loc: Sequence[int | str], located: bool = True) -> str:
    """`("body", "samples", 0, "loss_fn_inputs")` -> `samples[0].loss_fn_inputs`. Only a
    leading location (FastAPI's) is dropped: a field may be named `path` (Tinker's bodies)."""
    parts = list(loc)
    if located and parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:]
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part:
            out += f".{part}" if out else str(part)
    return out


_LEADING_FIELD = re.compile(r"^([a-z_]\w*(?:\[\d+\])*(?:\.\w+(?:\[\d+\])*)*)\b")


def from_validation(errors: Sequence[Any], prefix: str = "", located: bool = True) -> ApiError:
    """First pydantic error as a 400 naming its field; the rest are summarised in the message.

    Whole-object validators have an empty location; their messages start with the field path
    (a convention of `trainer.contract.specs`), which then becomes `param`.
    """
    first = errors[0]
    path = field_path(list(first.get("loc", ())), located)
    if prefix:
        path = f"{prefix}.{path}" if path else prefix
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    named = bool(path)
    if not path and (match := _LEADING_FIELD.match(message)):
        path = match.group(1)
    if first.get("type") == "json_invalid":
        return bad_request(f"request body is not valid JSON: {message}", "body", "invalid_json")
    text = f"{path}: {message}" if named else message
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more error(s))"
    return bad_request(text, path or "body")


def from_pydantic(exc: ValidationError, prefix: str = "") -> ApiError:
    return from_validation(exc.errors(include_url=False), prefix, located=False)


def is_disk_full(exc: BaseException) -> bool:
    """SQLite's SQLITE_FULL, or a file write's ENOSPC (no space) / EDQUOT (quota)."""
    if isinstance(exc, sqlite3.OperationalError):
        code = getattr(exc, "sqlite_errorcode", None)  # Python >= 3.11
        return code == sqlite3.SQLITE_FULL or "database or disk is full" in str(exc)
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def disk_full() -> ApiError:
    return ApiError(
        507,
        "insufficient storage: the worker's disk is full; retry once space is freed",
        code="insufficient_storage",
    )


def install_handlers(app: FastAPI) -> None:
    async def on_api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return exc.response()

    async def on_validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return from_validation(list(exc.errors())).response()

    async def on_http(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        param = {400: "body", 404: "path", 405: "method"}.get(exc.status_code)
        return ApiError(exc.status_code, str(exc.detail), param=param, code=code).response()

    async def on_storage(request: Request, exc: Exception) -> JSONResponse:
        if not is_disk_full(exc):
            raise exc  # anything else stays a 500, logged with its traceback
        log.error("%s %s: disk full: %s", request.method, request.url.path, exc)
        return disk_full().response()

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(sqlite3.OperationalError, on_storage)
    app.add_exception_handler(OSError, on_storage)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
