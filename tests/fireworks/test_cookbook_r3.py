"""The Fireworks cookbook's GRPO recipe, `recipes/rl_loop.py`, unchanged, with its default
`router_replay=True` on a tiny Qwen3-MoE (docs/semantics.md §12): the recipe asks the control
plane that the model is MoE, samples every rollout with `include_routing_matrix`, and sends the
matrices back on each datum's `model_input.routing_matrices` (completion-only, its default),
which the trainer forces. The served model is near uniform over a vocabulary with the two
answer tokens of `test_cookbook_rl.py`, so groups have reward variance and steps train.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.api.conftest import LiveServer, serve_in_thread
from tests.fireworks.test_cookbook import LORA_RANK, run_phase
from tests.fireworks.test_cookbook_rl import ANSWERS, ROWS, calls_to
from tests.tinker.conftest import build_served_model
from trainer.engine import moe_replay_keys

pytestmark = pytest.mark.fireworks

MOE_MODEL = "accounts/fireworks/models/qwen3-moe-uniform"


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("rl-moe-model")
    return build_served_model(
        where, scale=1.0, seed=3, tokenizer_dir=where, extra=ANSWERS, arch="qwen3_moe"
    )


@pytest.fixture(scope="module")
def moe_server(moe_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    storage = tmp_path_factory.mktemp("rl-moe-storage")
    with serve_in_thread(storage, {MOE_MODEL: moe_model}) as live:
        yield live


def test_rl_loop_replays_the_rollouts_routes(
    cookbook_py: Path,
    cookbook: Path,
    moe_server: LiveServer,
    moe_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    forced: list[int] = []  # per replayed datum, its forced positions (the server is in-process)
    inline = moe_replay_keys._inline

    def spy(*args: Any) -> dict[int, torch.Tensor]:
        found = inline(*args)
        forced.extend(int((r >= 0).all(-1).all(-1).sum()) for r in found.values())
        return found

    monkeypatch.setattr(moe_replay_keys, "_inline", spy)
    report = run_phase(
        cookbook_py,
        moe_server,
        cookbook,
        moe_model,
        tmp_path / "rl",
        recipe="rl",
        phase="first",
        base_model=MOE_MODEL,
        lora_rank=LORA_RANK,
        learning_rate=1e-3,
        epochs=1,
        max_seq_len=96,
        rows=ROWS,
        max_completion_tokens=40,
    )
    steps = report["result"]["steps"]
    assert 1 <= steps <= ROWS, report["result"]
    assert not calls_to(report, r" 5\d\d"), calls_to(report, r" 5\d\d")
    # every trained and reference datum forced its completion's positions (4 a group)
    assert len(forced) >= 4 * steps and all(n > 0 for n in forced), forced
