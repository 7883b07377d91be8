"""A Tinker client whose weights produce NaN fails its own samples alone, through the SDK.

All Tinker clients of a base model share one resource, so their concurrent samples run as one
generation batch; one client's broken adapter must fail only its own sample
(`sdk_scripts/nan_neighbour.py` drives the official SDK; this side judges).

How the hostile client gets there, with nothing but SDK calls: the worker refuses a learning
rate above 1e2 and undoes an optim-step that leaves a weight or optimizer state non-finite,
but weight decay is unbounded, so one step with `learning_rate * weight_decay = 1e37` makes
every adapter weight about 1e36 in magnitude: finite, so the step is kept, and far past what a
forward can carry, so its logits are NaN. `save_weights_and_get_sampling_client` serves those
weights (the RL face's test, `tests/faults/test_hostile.py`, writes NaN into a session in
process instead; here a client does it alone).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.api.conftest import serve_in_thread
from tests.tinker.conftest import SCRIPTS, SDK_MODEL, catalogue, run_in_venv
from tests.tinker.tinker_http import engine_session
from trainer.api.tinker.sampling import MAX_SAMPLER_SESSIONS
from trainer.engine.batching.sample_batch import SampleBatcher

# The SDK's concurrent requests reach the worker over about 15 ms; a window far longer than
# that puts all of them in one generation batch every time (the default, 2 ms, does by chance).
WINDOW_MS = 500.0
NEIGHBOURS = MAX_SAMPLER_SESSIONS - 1  # with the hostile one, every sampler session stays open


def test_a_nan_neighbour_fails_only_its_own_samples_through_the_sdk(
    venv_python: Path,
    served_models: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One hostile and three benign Tinker clients sample at once, in one batch: the hostile
    sample fails with NON_FINITE_LOSS (as it does alone) and each neighbour gets exactly the
    sequences it got sampling alone."""
    launched: list[int] = []  # the size of each generation of more than one job
    launch = SampleBatcher._launch

    def spy(self: SampleBatcher, jobs: list[Any]) -> None:
        launched.append(len(jobs))
        launch(self, jobs)

    monkeypatch.setattr(SampleBatcher, "_launch", spy)
    entry = catalogue(served_models, SDK_MODEL)
    engine = {"merge_window_ms": WINDOW_MS}
    with serve_in_thread(tmp_path / "storage", {}, model=entry, engine=engine) as live:
        script = str(SCRIPTS / "nan_neighbour.py")
        out = run_in_venv(venv_python, live, [script, SDK_MODEL, str(NEIGHBOURS)])
        hostile = engine_session(live, out["hostile_model"])
        weights = [p.detach() for p in hostile.policy.trainable.values()]

    # the poisoning step was a client's accepted optim-step: finite weights, and huge ones
    assert out["poison_metrics"]["learning_rate"] == 1.0, out["poison_metrics"]
    assert all(bool(torch.isfinite(w).all()) for w in weights)
    assert max(float(w.abs().max()) for w in weights) > 1e30
    # the four samples ran as one generation; the ones before it, one at a time, alone
    assert launched == [NEIGHBOURS + 1], launched
    alone, together = out["alone"], out["together"]
    for outcome in (alone["0"], together["0"]):
        assert "sequences" not in outcome, outcome
        assert "NON_FINITE_LOSS" in outcome["error"], outcome
        assert "logits are not finite" in outcome["error"], outcome
    for i in map(str, range(1, NEIGHBOURS + 1)):
        assert "sequences" in alone[i] and "sequences" in together[i], (alone[i], together[i])
        got, want = together[i]["sequences"], alone[i]["sequences"]
        assert [s["tokens"] for s in got] == [s["tokens"] for s in want]
        assert [s["stop"] for s in got] == [s["stop"] for s in want]
        for g, w in zip(got, want, strict=True):  # to a differently padded batch's rounding
            torch.testing.assert_close(
                torch.tensor(g["logprobs"]), torch.tensor(w["logprobs"]), rtol=1e-6, atol=1e-5
            )
