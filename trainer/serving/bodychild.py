"""The body parser's child process: one request per stdin line, one reply per stdout line.

A request names the spooled body (`src`), the file for its packed arrays (`blob`), the
`Bounds` to decode it within and, for a body that is not JSON, the decoder to use as
`module:function` (called as `function(raw, bounds)`, returning a dict that may hold 1-D
numpy arrays, raising `BodyError`). The reply is the body's skeleton (JSON) with each packed
array's place, kind and length. Design notes: `docs/design/serving.md`.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import importlib
import json
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer.serving.jsonparse import BodyError, Bounds, Packer
from trainer.serving.jsonscan import decode_body

Decoder = Callable[[bytes, Bounds], dict[str, Any]]


def load_decoder(name: str) -> Decoder:
    module, _, function = name.partition(":")
    decoder: Decoder = getattr(importlib.import_module(module), function)
    return decoder


def parse_file(src: Path, blob: Path, request: dict[str, Any]) -> dict[str, Any]:
    """The child's work for one request: the reply's `skeleton` and `arrays`."""
    raw = src.read_bytes()
    bounds = Bounds(**request.get("bounds", {}))
    with blob.open("wb") as handle:
        packer = Packer(handle) if request["pack"] else None
        if request.get("decoder"):
            value = load_decoder(request["decoder"])(raw, bounds)
            del raw
            if packer is not None:
                packer.pack_all(value, [])
        else:
            value = decode_body(raw, bounds, packer, empty_ok=request["empty_ok"])
    return {"skeleton": value, "arrays": packer.reply() if packer is not None else None}


def _reply(request: dict[str, Any]) -> dict[str, Any]:
    src, blob = Path(request["src"]), Path(request["blob"])
    try:
        return {"ok": True, **parse_file(src, blob, request)}
    except BodyError as exc:
        return {"ok": False, **exc.as_dict()}
    except MemoryError:
        error = BodyError("memory", "the request body is too large to parse in memory")
    except FileNotFoundError as exc:
        error = BodyError("missing", f"no such file: {exc.filename}")
    except OSError as exc:
        kind = "storage" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "crash"
        error = BodyError(kind, f"parsing the request body failed: {exc.strerror}")
    return {"ok": False, **error.as_dict()}


def _trim() -> None:
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the worker decides when the child stops
    out = sys.stdout
    for line in sys.stdin:
        reply = _reply(json.loads(line))
        # allow_nan and ASCII escapes: a skeleton may hold NaN or lone surrogates
        out.write(json.dumps(reply, separators=(",", ":")) + "\n")
        out.flush()
        del reply
        _trim()  # hand the parse's memory back to the system while idle


if __name__ == "__main__":
    main()
