"""Failures that are data: an error code the client can act on, and a message naming the field."""

from __future__ import annotations

ERROR_CODES = (
    "INVALID_INPUT",
    "NON_FINITE_LOSS",
    "SESSION_NOT_ACTIVE",
    "RESOURCE_EXHAUSTED",
    "INTERNAL_ERROR",
    "TIMEOUT",
)


class OperationError(Exception):
    """An operation failed in an expected way; nothing it touched was changed.

    `code` is the suffix of the wire enum `TRAINING_OPERATION_ERROR_CODE_<code>`.
    """

    def __init__(self, code: str, message: str, field: str | None = None) -> None:
        if code not in ERROR_CODES:
            raise ValueError(f"unknown operation error code {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field

    def __repr__(self) -> str:
        return f"OperationError({self.code}, {self.message!r})"


def invalid(field: str, message: str) -> OperationError:
    """Bad client input: the message starts with the field path, e.g. `samples[2].weights`."""
    return OperationError("INVALID_INPUT", f"{field}: {message}", field=field)


class InputError(OperationError, ValueError):
    """Bad client input refused by a rule of `trainer.contract.rules`: INVALID_INPUT, naming
    `field`, with the message `"{field}: {detail}"`.

    A `ValueError` too, so a pydantic validator that calls a rule refuses with this message;
    each face re-raises it in its own error type with its own field names.
    """

    field: str

    def __init__(self, field: str, detail: str) -> None:
        super().__init__("INVALID_INPUT", f"{field}: {detail}", field=field)
        self.detail = detail
