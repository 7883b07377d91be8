"""The files of a checkpoint: safetensors written straight from tensor memory, sha256 and fsync
overlapped with the writing, and a verification cache for downloads and resumes.

Where the time of a checkpoint write goes (`BENCHMARKS.md` row 6): sha256 runs at about half
the disk's write-and-fsync speed on the CPUs measured, so a write is fast only when hashing
overlaps everything else. `save_tensors` writes a file with one `write` per tensor from the
tensor's own memory (`safetensors.torch.save_file` took twice as long on the same tensors) and,
inside `CheckpointStore.write`, hands the closed file to a `Sealer` at once: its sha256 (read
back from the page cache, so the hash covers the bytes that are in the file) and its fsync run
in threads while the next file is written. Other files (JSON, `save_pretrained` exports) are
sealed when the writer returns.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import hashlib
import json
import mmap
import os
import re
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_BLOCK = 8 << 20
Stamp = tuple[int, int, int, int]
_SHA256 = re.compile(r"^[0-9a-f]{64}$")

# safetensors' dtype names, in the order its serialiser lays tensors out (largest alignment
# first, then by name): files written here are byte-identical to `save_file`'s.
_DTYPES: dict[torch.dtype, str] = {
    torch.uint64: "U64",
    torch.int64: "I64",
    torch.float64: "F64",
    torch.complex64: "C64",
    torch.float32: "F32",
    torch.uint32: "U32",
    torch.int32: "I32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.uint16: "U16",
    torch.int16: "I16",
    torch.float8_e8m0fnu: "F8_E8M0",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_RANK = {dtype: i for i, dtype in enumerate(_DTYPES)}


def sha256_file(path: Path) -> str:
    """sha256 of a file, read in large blocks into one reused buffer (hashlib drops the GIL)."""
    digest = hashlib.sha256()
    buf = bytearray(_BLOCK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            digest.update(view[:n])
    return digest.hexdigest()


def _sha256_sealed(path: Path) -> str:
    """sha256 of a file being sealed, hashed straight from the page cache through a read-only
    mapping (a quarter faster than `sha256_file`'s copies). Only for files of a checkpoint being
    written, which nothing truncates: a mapping of a file cut short under it raises SIGBUS."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size == 0:
            return hashlib.sha256().hexdigest()
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        with mmap.mmap(fh.fileno(), size, flags=flags, prot=mmap.PROT_READ) as mapped:
            return hashlib.sha256(mapped).hexdigest()


def fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _stamp(path: Path) -> Stamp:
    """What changes when a file's bytes change: size, inode, mtime and ctime (ctime cannot be
    set back by a user, unlike mtime)."""
    st = path.stat()
    return st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns


@dataclass(frozen=True)
class ManifestFile:
    """One file of a checkpoint as its manifest describes it."""

    name: str  # path within the download variant's directory
    rel: str  # path within the checkpoint directory
    path: Path
    size: int
    sha256: str


def manifest_files_of(manifest: Any) -> dict[str, dict[str, Any]]:
    """The manifest's `files`, checked for shape (relpath → {sha256, size}); ValueError if not."""
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        raise ValueError("manifest.json has no 'files' object")
    for rel, info in files.items():
        if (
            not isinstance(info, dict)
            or not isinstance(info.get("sha256"), str)
            or not _SHA256.match(info["sha256"])
            or type(info.get("size")) is not int
            or rel.startswith("/")
            or ".." in rel.split("/")
        ):
            raise ValueError(f"manifest.json has a malformed entry for {rel!r}")
    return files


# -- sealing: fsync + sha256, overlapped ----------------------------------------------------


class Sealer:
    """fsyncs and hashes files in threads, each as soon as it is handed over."""

    def __init__(self, workers: int = 8) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="seal")
        self._jobs: dict[
            Path, tuple[Stamp, concurrent.futures.Future[str], concurrent.futures.Future[None]]
        ] = {}

    def add(self, path: Path) -> None:
        """Start sealing a file that will not be written again."""
        stamp = _stamp(path)
        self._jobs[path] = (
            stamp,
            self._pool.submit(_sha256_sealed, path),
            self._pool.submit(fsync_file, path),
        )

    def finish(self, paths: list[Path]) -> dict[Path, str]:
        """Seal every path not sealed yet, wait for all; path → sha256 once all are durable. A
        file changed after `add` (rewritten by the writer) is sealed again."""
        for path in paths:
            job = self._jobs.get(path)
            if job is None or job[0] != _stamp(path):
                self.add(path)
        out: dict[Path, str] = {}
        for path in paths:
            _, digest, synced = self._jobs[path]
            synced.result()
            out[path] = digest.result()
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


_SEALER: contextvars.ContextVar[Sealer | None] = contextvars.ContextVar("sealer", default=None)


@contextlib.contextmanager
def sealing(sealer: Sealer) -> Iterator[None]:
    """Files that `save_tensors` closes inside this block are handed to `sealer` at once."""
    token = _SEALER.set(sealer)
    try:
        yield
    finally:
        _SEALER.reset(token)


def seal_files(paths: list[Path]) -> dict[Path, str]:
    """fsync every file and compute its sha256, overlapped: a file's pages are hashed from the
    page cache while the kernel flushes them, and files proceed in parallel (hashlib and fsync
    both release the GIL). Returns path → sha256 once every file is durable. Inside
    `sealing()`, the files already handed to that sealer are not sealed twice."""
    if not paths:
        return {}
    active = _SEALER.get()
    if active is not None:
        return active.finish(paths)
    sealer = Sealer(min(8, 2 * len(paths)))
    try:
        return sealer.finish(paths)
    finally:
        sealer.close()


# -- writing safetensors ---------------------------------------------------------------------


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]


def _write_all(fh: Any, data: bytes | memoryview) -> None:
    view = memoryview(data).cast("B")
    while view.nbytes:
        view = view[fh.write(view) :]


def save_tensors(
    tensors: Mapping[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None
) -> None:
    """Write a safetensors file (byte-identical to `safetensors.torch.save_file`) from the
    tensors' own memory, one `write` per tensor, with no copy of the whole dict: a tensor on
    another device comes to the CPU one at a time. Inside `sealing()` the closed file is handed
    to the sealer at once. The tensors must not change while this runs; once it returns the
    file is final and they may."""
    order = sorted(tensors, key=lambda name: (_RANK[tensors[name].dtype], name))
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in order:
        tensor = tensors[name]
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    # a new inode, never a truncation: a sealer may still be hashing an earlier file of this
    # name through a mapping, which a truncation would turn into SIGBUS
    path.unlink(missing_ok=True)
    with open(path, "xb", buffering=0) as fh:
        _write_all(fh, len(text).to_bytes(8, "little") + text)
        for name in order:
            _write_all(fh, _raw_bytes(tensors[name]))
    sealer = _SEALER.get()
    if sealer is not None:
        sealer.add(path)


# -- verification with a cache ---------------------------------------------------------------


class VerifiedFiles:
    """Remembers which files matched which sha256, keyed on the file's stamp (size, inode,
    mtime, ctime): a file downloaded or resumed again is not hashed again unless it changed.
    Concurrent checks of one file hash it once."""

    def __init__(self, max_entries: int = 65536) -> None:
        self._ok: dict[Path, tuple[Stamp, str]] = {}
        self._locks: dict[Path, threading.Lock] = {}
        self._guard = threading.Lock()
        self._max = max_entries

    def matches(self, path: Path, sha256: str, size: int) -> str | None:
        """None when `path` holds `size` bytes hashing to `sha256`, else what is wrong."""
        with self._guard:
            lock = self._locks.setdefault(path, threading.Lock())
        with lock:
            try:
                stamp = _stamp(path)
            except FileNotFoundError:
                return "is missing"
            except OSError as exc:
                return f"cannot be read ({exc.strerror or exc})"
            if stamp[0] != size:
                return f"has {stamp[0]} bytes, its manifest says {size}"
            with self._guard:
                known = self._ok.get(path)
            if known == (stamp, sha256):
                return None
            try:
                actual = sha256_file(path)
            except OSError as exc:
                return f"cannot be read ({exc.strerror or exc})"
            if actual != sha256:
                return f"fails its sha256 (manifest {sha256[:12]}…, file {actual[:12]}…)"
            with self._guard:
                if len(self._ok) >= self._max:  # bounded: forget all, re-hash on demand
                    self._ok.clear()
                    self._locks = {path: lock}
                self._ok[path] = (stamp, sha256)
            return None
