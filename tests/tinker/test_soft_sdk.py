"""Soft targets ((N, K) `target_tokens` and `weights`) through the official `tinker` SDK:
`sdk_scripts/soft_targets.py` drives the worker, and the numbers it printed are checked here
against a plain transformers forward of the served model (a new LoRA adapter is the base
model), against the 1-D call, and a client-side custom loss against the server's own
(docs/semantics.md §1, §18).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.api.conftest import LiveServer
from tests.tinker.conftest import SCRIPTS, SDK_MODEL, run_in_venv


@pytest.fixture(scope="module")
def run(venv_python: Path, tinker_server: LiveServer) -> dict[str, Any]:
    return run_in_venv(venv_python, tinker_server, [str(SCRIPTS / "soft_targets.py"), SDK_MODEL])


@pytest.fixture(scope="module")
def reference(run: dict[str, Any], served_models: dict[str, Path]) -> list[np.ndarray]:
    """Each datum's (N, K) logprobs of its targets under the served base model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(served_models[SDK_MODEL], dtype=torch.float32)
    out = []
    with torch.no_grad():
        for d in run["data"]:
            logits = model.eval()(torch.tensor([d["tokens"][:-1]])).logits[0].float()
            lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(d["targets"]))
            out.append(lp.double().numpy())
    return out


def soft_loss(run: dict[str, Any], lps: list[np.ndarray]) -> float:
    return float(sum(-(np.asarray(d["weights"]) * lp).sum() for d, lp in zip(run["data"], lps)))


def test_forward_reads_n_by_k_logprobs(run: dict[str, Any], reference: list[np.ndarray]) -> None:
    fwd = run["forward_dense"]
    assert fwd["shapes"] == [list(lp.shape) for lp in reference] == [[12, 8]] * 3
    for got, want in zip(fwd["logprobs"], reference, strict=True):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)
    assert fwd["metrics"]["loss:sum"] == pytest.approx(soft_loss(run, reference), rel=1e-5)
    assert fwd["metrics"]["loss/tokens:sum"] == 3 * 4  # the positions with weights


def test_sparse_csr_encoding_reads_the_same(run: dict[str, Any]) -> None:
    assert run["encodings"] == [[True, True]] * 3  # the SDK did send CSR
    assert run["forward_sparse"] == run["forward_dense"]


def test_one_column_is_the_1d_call(run: dict[str, Any]) -> None:
    column, flat = run["forward_one_column"], run["forward_1d"]
    assert column["shapes"] == [[12, 1]] * 3 and flat["shapes"] == [[12]] * 3
    for got, want in zip(column["logprobs"], flat["logprobs"], strict=True):
        assert [row[0] for row in got] == want
    assert column["metrics"]["loss:sum"] == flat["metrics"]["loss:sum"]


def test_a_bad_shape_is_a_400_naming_the_field(run: dict[str, Any]) -> None:
    error = run["bad_shape_error"]
    assert error is not None and "400" in error, error
    assert "forward_backward_input.data[0].loss_fn_inputs.weights.shape" in error, error


def test_custom_loss_equals_the_builtin_soft_loss(
    run: dict[str, Any], reference: list[np.ndarray]
) -> None:
    """The SDK's custom loss runs a (N, K) forward, then sends -dL/dlp as 2-D (CSR) weights:
    the same loss, and after one Adam step the same model, as `cross_entropy` itself."""
    want = soft_loss(run, reference)
    assert run["fb_builtin"]["metrics"]["loss:sum"] == pytest.approx(want, rel=1e-5)
    assert run["fb_custom"]["metrics"]["loss:sum"] == pytest.approx(want, rel=1e-5)
    assert run["fb_custom"]["metrics"]["soft_ce"] == pytest.approx(want, rel=1e-5)
    builtin, custom = run["after_builtin"]["logprobs"], run["after_custom"]["logprobs"]
    for a, b, before in zip(builtin, custom, reference, strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)
        assert np.abs(np.asarray(a) - before).max() > 1e-3  # the step moved the model
