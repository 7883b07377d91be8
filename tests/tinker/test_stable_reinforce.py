"""`stable_reinforce` (docs/semantics.md §13) through the official `tinker` SDK.

`sdk_scripts/stable_reinforce.py` samples with `record_stability_info=True`, trains on datums
whose provenance is built as tinker-cookbook's `rl_loop.py` builds it, and sends every malformed
request the contract refuses. Here each returned loss and metric is checked against rule 13's
formula, written below, evaluated on the trainer's logprobs the call returned (`p_t`) and the
sampler's logprobs the sample returned (`q_t`, float32 on the wire as in the record).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.api.conftest import LiveServer
from tests.tinker.conftest import SCRIPTS, SDK_MODEL, run_in_venv


@pytest.fixture(scope="module")
def run(venv_python: Path, tinker_server: LiveServer) -> dict[str, Any]:
    return run_in_venv(
        venv_python, tinker_server, [str(SCRIPTS / "stable_reinforce.py"), SDK_MODEL]
    )


def rule_13(run: dict[str, Any], trainer_logprobs: list[list[float]], kl: float, c: float):
    """Rule 13 term by term: (loss, mean w, truncated fraction, mean p - q, tokens)."""
    pad = len(run["prompt"]) - 1
    loss, weights, truncated, diffs = 0.0, [], 0, []
    for seq, advantage, lps in zip(run["sequences"], run["advantages"], trainer_logprobs):
        assert len(lps) == pad + len(seq["tokens"])
        for t, q in enumerate(seq["logprobs"]):
            p = lps[pad + t]
            ratio = math.exp(p - q)
            w = min(ratio, c)
            loss += -w * advantage * p + kl * (math.exp(q - p) - (q - p) - 1)
            weights.append(w)
            truncated += ratio > c
            diffs.append(p - q)
    n = len(weights)
    return loss, sum(weights) / n, truncated / n, sum(diffs) / n, n


def check(run: dict[str, Any], result: dict[str, Any], kl: float, c: float) -> dict[str, float]:
    loss, w_mean, truncated, diff, n = rule_13(run, result["logprobs"], kl, c)
    m = result["metrics"]
    assert m["loss:sum"] == pytest.approx(loss, rel=1e-5, abs=1e-5)
    assert m["loss/is_weight:mean"] == pytest.approx(w_mean, rel=1e-5, abs=1e-6)
    assert m["loss/truncated_fraction:mean"] == pytest.approx(truncated, abs=1e-9)
    assert m["loss/log_ratio:mean"] == pytest.approx(diff, rel=1e-4, abs=1e-6)
    assert m["loss/tokens:sum"] == n
    return {"truncated": truncated, "diff": diff}


def test_on_policy_loss_is_rule_13_with_ratio_one(run: dict[str, Any]) -> None:
    config = run["config"]
    got = check(run, run["on_policy"], config["kl_coeff"], config["truncation"])
    # the trainer and the sampler are the same weights: p = q up to float32 rounding
    assert abs(got["diff"]) < 1e-4 and got["truncated"] == 0
    pad = len(run["prompt"]) - 1
    for seq, lps in zip(run["sequences"], run["on_policy"]["logprobs"]):
        np.testing.assert_allclose(lps[pad:], seq["logprobs"], atol=2e-4)


def test_off_policy_loss_truncates_and_adds_k3(run: dict[str, Any]) -> None:
    """After a step the records are stale: ratios spread beyond C and the k3 term counts."""
    config = run["config"]
    got = check(run, run["off_policy"], config["kl_coeff"], config["truncation"])
    assert 0 < got["truncated"] < 1, got
    assert abs(got["diff"]) > 1e-3, got


def test_gradient_is_rule_13s(run: dict[str, Any]) -> None:
    """The step taken with stable_reinforce equals the step of a twin (same initial weights)
    whose gradient came from rule 13 written in torch on the client (forward_backward_custom):
    after it, both give the same logprobs."""
    on_policy = run["on_policy"]["metrics"]["loss:sum"]
    assert run["twin_loss"] == pytest.approx(on_policy, rel=1e-5, abs=1e-5)
    for ours, twin in zip(run["off_policy"]["logprobs"], run["twin_logprobs"], strict=True):
        np.testing.assert_allclose(ours, twin, atol=1e-4)
    moved = max(
        abs(a - b)
        for ours, before in zip(run["off_policy"]["logprobs"], run["on_policy"]["logprobs"])
        for a, b in zip(ours, before)
    )
    assert moved > 0.05  # the step moved the logprobs far more than the tolerance


def test_default_config_is_kl_0_and_truncation_2(run: dict[str, Any]) -> None:
    result = {"metrics": run["default_config"], "logprobs": run["off_policy"]["logprobs"]}
    check(run, result, 0.0, 2.0)


@pytest.mark.parametrize(
    ("case", "field"),
    [
        ("no_provenance", "forward_backward_input.data[0].model_input_spans"),
        ("unknown_id", "forward_backward_input.data[0].model_input_spans[0].sequence_id"),
        ("foreign_id", "forward_backward_input.data[0].model_input_spans[0].sequence_id"),
        ("not_recorded", "forward_backward_input.data[0].model_input_spans[0].sequence_id"),
        ("input_differs", "forward_backward_input.data[0].model_input_spans[1]"),
        ("target_differs", "forward_backward_input.data[0].loss_fn_input_spans[1]"),
        ("advantage_on_prompt", "forward_backward_input.data[0].loss_fn_inputs.advantages"),
        ("not_tiling", "forward_backward_input.data[0].model_input_spans"),
        ("past_the_record", "forward_backward_input.data[0].loss_fn_input_spans[1]"),
        ("bad_truncation", "forward_backward_input.loss_fn_config.truncation"),
    ],
)
def test_refusals_name_the_field(run: dict[str, Any], case: str, field: str) -> None:
    error = run["errors"][case]
    assert error is not None and error.startswith("BadRequestError"), (case, error)
    assert f"{field}:" in error, (case, error)


def test_unknown_and_foreign_records_read_alike(run: dict[str, Any]) -> None:
    """A record of another Tinker session is refused exactly as an unknown one (nothing tells
    them apart), and its own session trains on it."""
    errors = run["errors"]

    def tail(case: str) -> str:
        return errors[case].split("sequence_id:", 1)[1].split("'", 2)[2]

    assert tail("foreign_id") == tail("unknown_id") == tail("not_recorded")
    assert errors["foreign_own_session"] is None
