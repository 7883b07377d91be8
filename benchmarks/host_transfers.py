"""Counting host transfers: the device-to-host crossings a piece of code makes.

On a CPU `.cpu()` dispatches nothing, so the profiler and `torch.cuda.set_sync_debug_mode` see
nothing there. `HostTransfers` counts the Python entry points that bring a tensor's values to
the host (`Tensor.cpu`, `.tolist`, `.item`, `.numpy`, `bool()`, `int()`, `float()`,
`operator.index`) plus every `aten._local_scalar_dense` that reaches the dispatcher from
elsewhere (C++ checks such as `torch.multinomial`'s `.item()`): one count per crossing, the
same on CPU and on CUDA. `per_step` splits the counts at each call of a wrapped function (the
model's forward), so a decode loop's crossings can be read per decode step.

A dispatch mode does not see what a backend kernel calls inside itself: `torch.multinomial`'s
two validity checks (`.item()`) run within its CPU or CUDA kernel. `profiled=True` counts every
`aten::_local_scalar_dense` with the profiler instead (the scalar entry points then count
there, once each), a profiler session per step; it slows the code down: count in a short run
apart from a timed one.

    with HostTransfers() as transfers:
        generate(model, jobs, forward=transfers.stepping(model))
    transfers.per_step  # [crossings before the first forward, after forward 1, ...]
"""

from __future__ import annotations

import collections
import threading
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity
from torch.utils._python_dispatch import TorchDispatchMode

ENTRY_POINTS = ("cpu", "tolist", "item", "numpy", "__bool__", "__int__", "__float__", "__index__")
"""The `torch.Tensor` methods that bring values to the host (`.cpu()` always counts: on a CPU
it is free, on a GPU it is the copy we want to see)."""

SCALAR_ENTRY_POINTS = ("item", "__bool__", "__int__", "__float__", "__index__")
"""The entry points that read one value (each an `aten::_local_scalar_dense`)."""


class _Scalars(TorchDispatchMode):
    """Counts `aten._local_scalar_dense` (a tensor's value read on the host) outside the
    patched entry points (those count themselves)."""

    def __init__(self, owner: HostTransfers) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            self.owner._count(f"aten.{func.__name__}")
        return func(*args, **(kwargs or {}))


class HostTransfers:
    """The module docstring. Counts only on the thread that entered it. `where` keeps the
    source line of each crossing (with `trace=True`) for a failing test's message."""

    def __init__(self, trace: bool = False, profiled: bool = False) -> None:
        self.trace, self.profiled = trace, profiled
        self.per_step: list[int] = [0]
        self.kinds: collections.Counter[str] = collections.Counter()
        self.where: collections.Counter[str] = collections.Counter()
        self._thread = threading.get_ident()
        self._inside = 0  # > 0 while a patched entry point runs (its inner dispatch: not again)
        self._saved: dict[str, Any] = {}
        self._mode = _Scalars(self)
        self._profiler: Any = None

    @property
    def total(self) -> int:
        return sum(self.per_step)

    @property
    def steps(self) -> int:
        """Forward calls seen (`stepping`)."""
        return len(self.per_step) - 1

    def stepping(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        """`forward`, starting a new step's count at each call."""

        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.profiled:
                self._stop_profiler()
            self.per_step.append(0)
            if self.profiled:
                self._start_profiler()
            return forward(*args, **kwargs)

        return counted

    def _count(self, kind: str) -> None:
        if self._inside or threading.get_ident() != self._thread:
            return
        self.per_step[-1] += 1
        self.kinds[kind] += 1
        if self.trace:
            frames = traceback.extract_stack(limit=12)
            ours = [f for f in frames if not f.filename.endswith(("host_transfers.py", "mode.py"))]
            if ours:
                self.where[f"{ours[-1].filename}:{ours[-1].lineno} {kind}"] += 1

    def _wrap(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        counted = not (self.profiled and name in SCALAR_ENTRY_POINTS)  # else the profiler's

        def entry(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if counted:
                self._count(name)
            self._inside += 1
            try:
                return real(tensor, *args, **kwargs)
            finally:
                self._inside -= 1

        return entry

    def __enter__(self) -> HostTransfers:
        for name in ENTRY_POINTS:
            real = getattr(torch.Tensor, name)
            self._saved[name] = torch.Tensor.__dict__.get(name)
            setattr(torch.Tensor, name, self._wrap(name, real))
        if self.profiled:
            self._start_profiler()
        else:
            self._mode.__enter__()
        return self

    def _start_profiler(self) -> None:
        self._profiler = torch.profiler.profile(activities=[ProfilerActivity.CPU])
        self._profiler.__enter__()

    def _stop_profiler(self) -> None:
        """The scalar reads the profiler saw since it started, counted to the current step."""
        self._profiler.__exit__(None, None, None)
        events = self._profiler.events() or []
        reads = sum(1 for e in events if e.name == "aten::_local_scalar_dense")
        self.per_step[-1] += reads
        self.kinds["aten::_local_scalar_dense"] += reads

    def __exit__(self, *exc: object) -> None:
        if self.profiled:
            self._stop_profiler()
        else:
            self._mode.__exit__(*exc)
        for name, saved in self._saved.items():
            if saved is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, saved)
        self._saved.clear()
