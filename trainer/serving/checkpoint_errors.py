"""A checkpoint write that fails on storage (disk full, quota, I/O error) is the operation's
expected failure, not a crash: it FAILs with a code and a message the user can act on.

The checkpoint store has already removed its partial directory, the catalogue is unchanged and
the session's training state was only read, so training continues. safetensors reports I/O
errors as its own `SafetensorError` (`... No space left on device (os error 28)`), not as
`OSError`; both are recognised here.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Callable
from typing import Any

from safetensors import SafetensorError

from trainer.checkpoint.store import CheckpointRecord
from trainer.contract.errors import OperationError
from trainer.serving.responses import training_checkpoint_json

# errnos meaning "the storage is out of room": the client can free space and retry
_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def write_failure(exc: OSError | SafetensorError) -> OperationError:
    """RESOURCE_EXHAUSTED for a full disk or quota, INTERNAL_ERROR for other I/O errors."""
    if isinstance(exc, OSError):
        number = exc.errno
        reason = exc.strerror or str(exc)
    else:
        match = _OS_ERROR.search(str(exc))
        number = int(match.group(1)) if match else None
        reason = os.strerror(number) if number is not None else str(exc)
    code = "RESOURCE_EXHAUSTED" if number in _FULL else "INTERNAL_ERROR"
    return OperationError(code, f"writing the checkpoint failed: {reason}")


def save_checkpoint(save: Callable[[], CheckpointRecord]) -> dict[str, Any]:
    """Run a checkpoint save; storage failures become an `OperationError`."""
    try:
        record = save()
    except (OSError, SafetensorError) as exc:
        raise write_failure(exc) from exc
    return {"checkpoint": training_checkpoint_json(record)}
