"""The official `tinker` SDK on a Gated DeltaNet hybrid (the tiny Qwen3.5 served as
`Qwen/Qwen3.5-9B`, tinker-cookbook 0.6.1's default family): the same SDK run as
`test_sdk.py` (`sdk_scripts/train_sample.py`), checked for the numbers that packing would get
wrong: multi-datum forwards against plain transformers of each sequence alone, sampled and
prompt logprobs against the trainer's forward (docs/semantics.md §20)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.api.conftest import LiveServer
from tests.tinker.conftest import SCRIPTS, SECOND_MODEL, run_in_venv
from tests.tinker.test_sdk import arr, base_logprobs


@pytest.fixture(scope="module")
def run(
    venv_python: Path, tinker_server: LiveServer, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    script = str(SCRIPTS / "train_sample.py")
    downloads = tmp_path_factory.mktemp("hybrid-downloads")
    return run_in_venv(venv_python, tinker_server, [script, SECOND_MODEL, str(downloads)])


def test_multi_datum_forward_equals_each_sequence_alone(
    run: dict[str, Any], served_models: dict[str, Path]
) -> None:
    reference = base_logprobs(served_models[SECOND_MODEL], run["data"])
    assert len(reference) > 1  # several datums in one call: state must not cross them
    for got, ref in zip(run["forward_all"], reference, strict=True):
        np.testing.assert_allclose(arr(got), ref, atol=1e-4)


def test_sampled_and_prompt_logprobs_equal_the_trainers(run: dict[str, Any]) -> None:
    sample = run["sample"]
    n = len(sample["prompt"])
    for seq, rescored in zip(sample["sequences"], run["rescored"], strict=True):
        np.testing.assert_allclose(arr(seq["logprobs"]), arr(rescored[n - 1 :]), atol=2e-3)
    plp = sample["prompt_logprobs"]
    assert len(plp) == n and plp[0] is None
    np.testing.assert_allclose(arr(plp[1:]), arr(run["rescored"][0][: n - 1]), atol=2e-3)
