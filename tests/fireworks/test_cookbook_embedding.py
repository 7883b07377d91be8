"""The Fireworks cookbook's `embedding_loop` (fw-ai/cookbook, `training/recipes/`), unchanged,
against the worker, in each of its three modes (docs/semantics.md §27): `embedding` (vectors to
the client, its InfoNCE gradients back), `cos_similarity_matrix` (similarity rows to the client,
dL/dS back) and `contrastive_loss` (InfoNCE on the worker).

One batch of 4 (query, positive) pairs, three epochs: three steps on the same pairs, each loss
measured before its update, so it falls. The three modes compute one objective (and one
gradient: `tests/engine/test_embeddings.py`), so their first losses agree.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.api.conftest import LiveServer
from tests.fireworks.conftest import QWEN
from tests.fireworks.test_cookbook import decreasing, finite, run_phase, series

pytestmark = pytest.mark.fireworks

MODES = ("embedding", "cos_similarity_matrix", "contrastive_loss")


def _losses(report: dict) -> list[float]:
    """The recipe's per-step loss: the client's (`train/loss`), or the worker's
    (`train/loss:sum`, contrastive_loss)."""
    return series(report["metrics"], "train/loss") or series(report["metrics"], "train/loss:sum")


def test_embedding_loop_runs_in_its_three_modes(
    cookbook_py: Path,
    cookbook: Path,
    fw_server: LiveServer,
    fw_models: dict[str, Path],
    tmp_path: Path,
) -> None:
    runs = {}
    for mode in MODES:
        report = run_phase(
            cookbook_py,
            fw_server,
            cookbook,
            fw_models[QWEN],
            tmp_path / mode,
            recipe="embed",
            phase="first",
            output_mode=mode,
            lora_rank=4,
            learning_rate=1e-3,
            epochs=3,
        )
        assert report["result"]["steps"] == 3, report["result"]
        assert series(report["metrics"], "train/step") == [1, 2, 3], report["metrics"]
        losses = _losses(report)
        assert finite(losses) and decreasing(losses), (mode, losses)
        runs[mode] = losses
        if mode == "contrastive_loss":
            recall = series(report["metrics"], "train/in_batch_recall_at_1:mean")
            assert finite(recall) and all(0 <= r <= 1 for r in recall), report["metrics"]
    # one objective: the first step's loss (the same weights in each run) is one number; the
    # later steps' differ a little, as AdamW's first update is near ±lr wherever a gradient
    # is near 0, so float noise in such a gradient moves the weights differently
    for mode in MODES[1:]:
        assert runs[mode][0] == pytest.approx(runs["embedding"][0], rel=1e-5), runs
