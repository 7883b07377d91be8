"""The worst request-body shapes on both faces, and the memory of a worker and its children.

Each shape is refused by the worker: `hostile_bodies(face, size_mb)` builds them at about
`size_mb` MB. Used by `benchmarks.bodies` and by `tests/tinker/test_big_bodies.py`.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

MB = 1_000_000
FACES = ("tinker-proto", "tinker-json", "rl")
PPO = {"type": "LOSS_TYPE_PPO"}


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _proto(size: int) -> dict[str, bytes]:
    model_id = b"\x0a\x01m"
    empty_datums = model_id + b"\x1a\x00" * (size // 2)  # field 3 (data), length 0
    entries = b"\x12\x00" * (size // 2)  # field 2 (loss_fn_inputs), an empty map entry
    empty_inputs = model_id + b"\x1a" + _varint(len(entries)) + entries
    return {"empty-datums": empty_datums, "empty-inputs": empty_inputs}


def _json(head: str, repeated: str, count: int, tail: str) -> bytes:
    return (head + ",".join([repeated] * count) + tail).encode()


def _tinker_json(size: int) -> dict[str, bytes]:
    head = '{"model_id": "m", "forward_backward_input": {"loss_fn": "cross_entropy", "data": ['
    chunk = '{"model_input": {"chunks": [{"type": "encoded_text", "tokens": ['
    return {
        "empty-datums": _json(head, "{}", size // 3, "]}}"),
        "one-long-datum": _json(head + chunk, "1", size // 2, ']}]}, "loss_fn_inputs": {}}]}}'),
    }


def _rl(size: int) -> dict[str, bytes]:
    head = '{"loss": ' + json.dumps(PPO) + ', "samples": ['
    chunk = '{"model_input": {"chunks": [{"encoded_text": {"tokens": ['
    return {
        "empty-samples": _json(head, "{}", size // 3, "]}"),
        "one-long-sample": _json(head + chunk, "1", size // 2, ']}}]}, "loss_fn_inputs": {}}]}'),
    }


def hostile_bodies(face: str, size_mb: float) -> dict[str, bytes]:
    """The worst shapes of `face` at about `size_mb` MB each, by name."""
    size = int(size_mb * MB)
    return {"tinker-proto": _proto, "tinker-json": _tinker_json, "rl": _rl}[face](size)


# -- memory of a process tree -------------------------------------------------------------


def status_kib(pid: int, key: str) -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(stat.parent.name))
    return out


def reset_peaks(pid: int) -> tuple[list[int], int]:
    """Reset the peak resident set (`VmHWM`) of `pid` and its children: (the pids, their
    resident sets now, KiB, summed)."""
    pids = [pid, *children(pid)]
    for p in pids:
        with contextlib.suppress(OSError):
            Path(f"/proc/{p}/clear_refs").write_text("5")
    return pids, sum(status_kib(p, "VmRSS") for p in pids)


def peak_kib(pids: list[int]) -> int:
    """The summed peak resident sets of `pids` and of any child the first one started since."""
    tree = dict.fromkeys([*pids, *children(pids[0])])
    return sum(status_kib(p, "VmHWM") for p in tree)
