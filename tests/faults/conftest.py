"""Long fault-test variants (`@pytest.mark.slow`) run only when asked for: `pytest -m slow` or
`TRAINER_SLOW=1`. CI's plain `pytest -q` runs the short versions."""

from __future__ import annotations

import os

import pytest


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("slow") is None:
        return
    wanted = os.environ.get("TRAINER_SLOW") == "1" or "slow" in (item.config.option.markexpr or "")
    if not wanted:
        pytest.skip("long variant: run with `pytest -m slow` or TRAINER_SLOW=1")
