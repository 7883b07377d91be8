"""Run at start-up by every Python process with this folder on its path: the replica and any
process vLLM starts from it (an engine core, workers, its model-inspection subprocess).

It asks Linux for permission to use AMX tile data (`arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)`): vLLM's CPU kernels use AMX where the CPU has it, and without the
permission their first AMX instruction kills the process with SIGILL (a small model's replica
died at its first decode step). Elsewhere (no AMX, an older kernel, not x86-64 Linux) the
request fails quietly. Then any `sitecustomize` this one shadows runs as well.
"""

from __future__ import annotations

import os
import platform
import sys

_SYS_ARCH_PRCTL = 158  # x86-64
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def request_amx() -> bool:
    """Whether this process may now use AMX tile data (False where it cannot: harmless)."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        args = (_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
        return int(libc.syscall(*(ctypes.c_long(a) for a in args))) == 0
    except Exception:
        return False


def _run_shadowed() -> None:
    """The next `sitecustomize` on the path (a distribution's), which this one hides."""
    try:
        import importlib.machinery
        import importlib.util

        here = os.path.dirname(os.path.abspath(__file__))
        rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
        if spec is not None and spec.loader is not None:
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
    except Exception:
        pass


request_amx()
_run_shadowed()
