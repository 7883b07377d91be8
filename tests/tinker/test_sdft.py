"""tinker-cookbook 0.6.1's own SDFT recipe (`recipes/sdft/train.py`), unchanged, against the
worker, for two steps on the tiny cookbook model with synthetic SciKnowEval rows
(`sdft_runner.py` replaces only the dataset download and registers the tokenizer).

Its defaults need what this worker adds for it: LoRA rank 128 (docs/semantics.md §9), the
teacher's top-20 prompt logprobs, and `cross_entropy` on (N, 20) soft targets (§1), or, in
reverse mode, a client-side custom loss over (N, 20) logprobs whose backward sends 2-D
(sparse CSR) weights.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from tests.api.conftest import LiveServer
from tests.tinker.conftest import COOKBOOK_MODEL, HERE, run_in_venv, tokenizer_of
from trainer.api.tinker.records import TinkerFuture, TinkerModel

RUNNER = str(HERE / "sdft_runner.py")
TOPK = 20  # the recipe's default


def _run(
    venv_python: Path,
    server: LiveServer,
    served_models: dict[str, Path],
    log_path: Path,
    *extra: str,
) -> tuple[dict[str, Any], TinkerModel, list[TinkerFuture]]:
    """The recipe for 2 steps; its output, the Tinker model it trained and that model's
    forward(-backward) futures."""
    db = server.app.state.tinker.db
    before = {m.id for m in db.select(TinkerModel)}
    out = run_in_venv(
        venv_python,
        server,
        [
            RUNNER,
            str(tokenizer_of(served_models, COOKBOOK_MODEL)),
            COOKBOOK_MODEL,
            str(log_path),
            "dataset=sciknoweval",
            "groups_per_batch=2",
            "max_tokens=8",
            "max_steps=2",
            "eval_every=0",
            "learning_rate=0.001",
            *extra,
        ],
        timeout=600,
    )
    (model,) = [m for m in db.select(TinkerModel) if m.id not in before]
    futures = db.select(
        TinkerFuture,
        "model_id = ? AND kind IN ('ForwardBackward', 'Forward')",
        (model.id,),
        "ORDER BY created_at",
    )
    return out, model, futures


def _logprobs(future: TinkerFuture) -> list[np.ndarray]:
    assert future.status == "done" or future.result is not None, future
    assert future.result is not None
    return [
        np.asarray(o["logprobs"]["data"]).reshape(o["logprobs"]["shape"])
        for o in future.result["loss_fn_outputs"]
    ]


def test_sdft_default_mode_runs_with_its_defaults(
    venv_python: Path,
    tinker_server: LiveServer,
    served_models: dict[str, Path],
    tmp_path: Path,
) -> None:
    out, model, futures = _run(venv_python, tinker_server, served_models, tmp_path / "sdft")
    assert model.lora_rank == 128  # the recipe's default, not overridden
    metrics = out["metrics"]
    assert [m["progress/batch"] for m in metrics] == [0, 1], metrics
    # The recipe skips each completion's first 3 tokens (its reference does), so a step whose
    # sampled completions are all that short scores no position: entropy, weights and
    # gradient are then 0. Sampling is unseeded; one step at least has scored positions.
    for m in metrics:
        assert m["sdft/topk"] == TOPK
        # the renormalized top-20 teacher distribution's entropy, in [0, ln 20]
        assert 0.0 <= m["sdft/mean_teacher_entropy"] <= math.log(TOPK) + 1e-6, m
        assert m["grad_norm"] >= 0 and math.isfinite(m["grad_norm"]), m
        if m["sdft/mean_teacher_entropy"] > 0:  # scored positions move the weights
            assert m["grad_norm"] > 0, m
    assert any(m["sdft/mean_teacher_entropy"] > 0 for m in metrics), metrics
    trained = [f for f in futures if f.kind == "ForwardBackward"]
    assert len(trained) == 2, [f.kind for f in futures]
    for future in trained:
        assert future.result is not None
        for lp in _logprobs(future):  # one logprob per target: (N, 20)
            assert lp.ndim == 2 and lp.shape[1] == TOPK, lp.shape
            assert np.all(np.isfinite(lp)) and np.all(lp <= 0.0)
        # Σ_t Σ_k −p_tk·lp_tk with p a distribution over k: positive where any position is
        # scored, finite
        loss = future.result["metrics"]["loss:sum"]
        assert 0.0 <= loss < math.inf, future.result["metrics"]
    assert any(f.result["metrics"]["loss:sum"] > 0 for f in trained if f.result), trained
    assert [c["name"] for c in out["checkpoints"]][-1] == "final", out["checkpoints"]


def test_sdft_reverse_mode_runs_its_custom_loss(
    venv_python: Path,
    tinker_server: LiveServer,
    served_models: dict[str, Path],
    tmp_path: Path,
) -> None:
    out, model, futures = _run(
        venv_python, tinker_server, served_models, tmp_path / "sdft-rev", "reverse=true"
    )
    assert model.lora_rank == 128
    metrics = out["metrics"]
    assert [m["progress/batch"] for m in metrics] == [0, 1], metrics
    # as in the default mode, a step whose completions are all 3 tokens or fewer scores no
    # position (the recipe then logs no mean; about 1 step in 120 when measured); one does
    for m in metrics:
        assert math.isfinite(m["sdft/reverse_kl_loss"]), m
        assert m["grad_norm"] >= 0 and math.isfinite(m["grad_norm"]), m
        if m["sdft/reverse_kl_positions"] > 0:
            # KL between two distributions renormalized over the teacher's top 20: >= 0
            assert m["sdft/reverse_kl_mean"] >= -1e-6, m
            assert m["grad_norm"] > 0, m  # scored positions move the weights
    assert any(m["sdft/reverse_kl_positions"] > 0 for m in metrics), metrics
    # each step: the SDK's forward of (N, 20) logprobs, then its backward with 2-D weights
    assert [f.kind for f in futures] == ["Forward", "ForwardBackward"] * 2, futures
    for future in futures:
        for lp in _logprobs(future):
            assert lp.ndim == 2 and lp.shape[1] == TOPK, lp.shape
