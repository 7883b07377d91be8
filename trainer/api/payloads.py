"""Large-payload offload (contract §2.9): JSON bodies and results stored as files per session.

The SDK uploads a request body over 0.5 MiB to a signed upload URL and sends `payload_id` in a
shrunk inline body; the server reads the real body back here. Results too large to answer
inline are written here and returned as `payload_id`, which the SDK downloads and merges.
Files are deleted when their session stops.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from trainer.api.errors import ApiError, bad_request

_ID = re.compile(r"^pl_[0-9a-f]{32}$")


class PayloadStore:
    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = root
        self.max_bytes = max_bytes
        root.mkdir(parents=True, exist_ok=True)

    def new_id(self) -> str:
        return f"pl_{uuid.uuid4().hex}"

    def path(self, session_id: str, payload_id: str) -> Path:
        if not _ID.match(payload_id):
            raise bad_request(f"payload_id: malformed id {payload_id!r}", "payload_id")
        return self.root / session_id / f"{payload_id}.json"

    async def write_stream(
        self, session_id: str, payload_id: str, chunks: AsyncIterator[bytes]
    ) -> int:
        """Stream an upload to disk (atomically renamed into place); 413 past `max_bytes`."""
        target = self.path(session_id, payload_id)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".part")
        size = 0
        with partial.open("wb") as handle:
            async for chunk in chunks:
                size += len(chunk)
                if size > self.max_bytes:
                    handle.close()
                    partial.unlink(missing_ok=True)
                    raise ApiError(
                        413, f"payload exceeds {self.max_bytes} bytes", code="payload_too_large"
                    )
                handle.write(chunk)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(partial, target)
        return size

    def write_json(self, session_id: str, value: dict[str, Any]) -> str:
        payload_id = self.new_id()
        target = self.path(session_id, payload_id)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".part")
        partial.write_bytes(json.dumps(value, separators=(",", ":")).encode())
        os.replace(partial, target)
        return payload_id

    def read_json(self, session_id: str, payload_id: str) -> dict[str, Any]:
        target = self.path(session_id, payload_id)
        if not target.is_file():
            raise bad_request(
                f"payload_id: no uploaded payload {payload_id!r} for this session", "payload_id"
            )
        try:
            value = json.loads(target.read_bytes())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise bad_request(
                f"payload_id: the uploaded payload is not JSON ({exc})", "payload_id"
            ) from None
        if not isinstance(value, dict):
            raise bad_request("payload_id: the uploaded payload is not a JSON object", "payload_id")
        return value

    def drop_session(self, session_id: str) -> None:
        shutil.rmtree(self.root / session_id, ignore_errors=True)


def offload_result(
    store: PayloadStore, session_id: str, output: dict[str, Any], limit: int
) -> dict[str, Any]:
    """Keep `loss` and `metrics` inline; move the rest to a payload when the output is large."""
    if len(json.dumps(output, separators=(",", ":"))) <= limit:
        return output
    inline = {k: v for k, v in output.items() if k in ("loss", "metrics", "step")}
    heavy = {k: v for k, v in output.items() if k not in inline}
    if not heavy:
        return output
    return {**inline, "payload_id": store.write_json(session_id, heavy)}
