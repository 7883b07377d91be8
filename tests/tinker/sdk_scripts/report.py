"""How an SDK script reports to the pytest side (`run_in_venv` reads its last JSON line)."""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from typing import Any


def print_result(main: Callable[[], dict[str, Any]]) -> None:
    """Print what `main` returns as one JSON line; on any exception its traceback, exit 1."""
    try:
        result = main()
    except Exception:
        traceback.print_exc()
        sys.exit(1)
    print(json.dumps(result), flush=True)


def error_text(fn: Callable[[], Any]) -> str | None:
    """What `fn()` raised, as `<type>: <message>` (None when it returned)."""
    try:
        fn()
    except Exception as exc:  # the script reports what the SDK raised
        return f"{type(exc).__name__}: {exc}"
    return None
