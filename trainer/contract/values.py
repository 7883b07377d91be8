"""Scalar wire values and the engine's bounds on them, shared by the specs and the API.

- Integers sent as strings (protobuf int64 in JSON) take ASCII digits only: `int()` alone
  would read "٣" as 3, fail on "²" and raise past 4,300 digits.
- Seeds are int64; `torch.Generator.manual_seed` takes them all (it fails past 2**64 - 1).
- A sampling temperature is 0 (greedy) or at least `MIN_TEMPERATURE`; LoRA's alpha is at most
  `MAX_LORA_ALPHA`, and a model admits ranks up to `DEFAULT_MAX_LORA_RANK` unless its catalogue
  entry says otherwise; a local location fits the filesystem's `PATH_MAX` and `NAME_MAX`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator
from pydantic.json_schema import WithJsonSchema

_ASCII_INT = re.compile(r"[+-]?0*([0-9]+)", re.ASCII)
MAX_INT_DIGITS = 20
"""An integer sent as a string has at most 20 significant digits: every 64-bit value fits."""

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
# The LoRA branch is scaled by alpha/rank; past 2**16 the scale alone saturates float16
# activations (max 65504), so larger values only produce non-finite losses.
MAX_LORA_ALPHA = 2**16
# Sampling divides the logits by the temperature; below this (but above 0, which is greedy)
# float32 logits overflow, or the temperature itself rounds to 0 in float32.
MIN_TEMPERATURE = 1e-6
PATH_MAX, NAME_MAX = 4096, 255  # Linux: bytes in a path, and in one of its components
# A model's default `max_lora_rank`: the smallest power of two that admits every default rank
# of tinker-cookbook 0.6.1's recipes (on-policy distillation, multi-teacher, off-policy
# reasoning and SDFT default to 128; the rest to 64 or less).
DEFAULT_MAX_LORA_RANK = 128


def parse_int_text(text: str) -> int | None:
    """ASCII decimal digits (optional sign, at most `MAX_INT_DIGITS` significant ones) -> int;
    None for anything else."""
    match = _ASCII_INT.fullmatch(text.strip())
    if match is None or len(match.group(1)) > MAX_INT_DIGITS:
        return None
    return int(match.group(0))


def int_from_str(value: Any) -> Any:
    """Protobuf int64 fields arrive as JSON strings; accept "12" as 12, refuse "1.5"."""
    if isinstance(value, str):
        number = parse_int_text(value)
        if number is None:
            shown = value if len(value) <= 40 else f"{value[:40]}... ({len(value)} characters)"
            raise ValueError(
                f"expected an integer of at most {MAX_INT_DIGITS} ASCII digits, got {shown!r}"
            )
        return number
    if isinstance(value, bool):
        raise ValueError("expected an integer, got a boolean")
    return value


IntLike = Annotated[int, BeforeValidator(int_from_str)]


def _seed_range(value: int) -> int:
    if not SEED_MIN <= value <= SEED_MAX:
        raise ValueError(f"must be an int64, in [-2**63, 2**63 - 1]; got {value}")
    return value


Seed = Annotated[
    IntLike,
    AfterValidator(_seed_range),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "integer", "minimum": SEED_MIN, "maximum": SEED_MAX},
                {"type": "string", "pattern": "^[+-]?[0-9]{1,19}$"},
            ],
            "description": "an int64, as a JSON number or a string",
        }
    ),
]


def check_temperature(value: float) -> float:
    if 0.0 < value < MIN_TEMPERATURE:
        raise ValueError(
            f"must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {value!r}: the logits "
            "are divided by it and would overflow"
        )
    return value


def check_location(value: str | None) -> str | None:
    """A hub id or a local path: printable, within `PATH_MAX` bytes and `NAME_MAX` per part."""
    if value is None:
        return value
    if not value.isprintable():
        raise ValueError("control characters (NUL included) are not allowed in a location")
    if len(value.encode()) > PATH_MAX:
        raise ValueError(f"at most {PATH_MAX} bytes")
    longest = max(len(part.encode()) for part in value.split("/"))
    if longest > NAME_MAX:
        raise ValueError(f"a path component has {longest} bytes; the limit is {NAME_MAX}")
    return value
