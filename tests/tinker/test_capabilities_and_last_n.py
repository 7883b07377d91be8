"""`get_server_capabilities` and `prompt_logprobs_last_n`, through the official SDK
(`sdk_scripts/logprobs_last_n.py` drives it; this side judges).

- Capabilities come from the catalogue: every served model, its context length (the model's
  own `max_position_embeddings`, read here from its config.json), trainable and sampleable.
- `compute_logprobs(prompt, prompt_logprobs_last_n=N)`: the last N entries are the whole
  prompt's, the earlier ones None, for the SDK's own check and ours; top-k rows likewise; an N
  the server refuses comes back as a 400 naming the field, not retried.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.api.conftest import LiveServer
from tests.tinker.conftest import SCRIPTS, SDK_MODEL, run_in_venv


@pytest.fixture(scope="module")
def run(venv_python: Path, tinker_server: LiveServer) -> dict[str, Any]:
    return run_in_venv(
        venv_python, tinker_server, [str(SCRIPTS / "logprobs_last_n.py"), SDK_MODEL], timeout=300
    )


def test_capabilities_list_the_catalogue(
    run: dict[str, Any], served_models: dict[str, Path]
) -> None:
    got = {m["model_name"]: m for m in run["capabilities"]}
    assert set(got) == set(served_models), got
    for name, location in served_models.items():
        config = json.loads((location / "config.json").read_text())
        assert got[name] == {
            "model_name": name,
            "max_context_length": config["max_position_embeddings"],
            "trainable": True,
            "sampleable": True,
        }


def test_compute_logprobs_last_n_scores_the_suffix(run: dict[str, Any]) -> None:
    full = run["full"]
    n_prompt = len(full)
    assert full[0] is None and all(isinstance(v, float) for v in full[1:]), full
    assert sorted(int(n) for n in run["last_n"]) == [1, 4, n_prompt - 1]
    for n_text, got in run["last_n"].items():
        n = int(n_text)
        cut = n_prompt - n
        assert len(got) == n_prompt and got[:cut] == [None] * cut, (n, got)
        # float32 on the wire, the suffix's head run apart from the prefix: equal to rounding
        np.testing.assert_allclose(got[cut:], full[cut:], atol=1e-5, rtol=0)
    assert run["sample_last_4"][: n_prompt - 4] == [None] * (n_prompt - 4)
    np.testing.assert_allclose(run["sample_last_4"][-4:], full[-4:], atol=1e-5, rtol=0)


def test_topk_prompt_logprobs_follow_last_n(run: dict[str, Any]) -> None:
    full, last = run["topk_full"], run["topk_last_4"]
    assert len(full) == len(last)
    cut = len(full) - 4
    assert last[:cut] == [None] * cut, last
    for row, ref in zip(last[cut:], full[cut:], strict=True):
        assert len(row) == 3 and [t for t, _ in row] == [t for t, _ in ref]
        np.testing.assert_allclose([v for _, v in row], [v for _, v in ref], atol=1e-5)


def test_last_n_out_of_range_is_a_400_naming_it(run: dict[str, Any]) -> None:
    error = run["too_long"]
    assert error is not None and error.startswith("BadRequestError"), error
    assert "prompt_logprobs_last_n" in error and "len(prompt) - 1" in error, error
