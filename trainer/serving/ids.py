"""Every id a client puts in a URL path is checked before any handler sees it.

Ids become file names (checkpoint directories, payload files) and catalogue keys, so they keep
to one safe alphabet: no `/`, no leading `.`, no `..` segment, bounded length. A path parameter
outside it is a 400 naming the parameter, so no path built from a client string can leave the
storage directory. (`resume_from_hf_checkpoint`, the one body field that names a local
directory, is checked in `trainer.serving.resume`.)
"""

from __future__ import annotations

import re

from fastapi import Request

from trainer.serving.errors import bad_request

SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}(?:\.[A-Za-z0-9_-]{1,32}){0,3}$")
"""Letters, digits, `_` and `-`, plus up to three dot-separated suffixes (`adapter_model.
safetensors`): a dot never starts a name nor follows another dot."""


def is_safe_id(value: str) -> bool:
    return SAFE_ID.fullmatch(value) is not None


async def check_path_ids(request: Request) -> None:
    """FastAPI dependency: refuse any path parameter that is not a safe id."""
    for name, value in request.path_params.items():
        if not isinstance(value, str) or not is_safe_id(value):
            raise bad_request(
                f"{name}: {value!r} is not a valid id (letters, digits, '_', '-' and "
                "single dots inside, at most 128 characters)",
                name,
                "invalid_id",
            )
