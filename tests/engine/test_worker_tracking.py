"""The worker logs a session's metrics to W&B when `metadata.wandb` is set (offline here)."""

from __future__ import annotations

import pytest

from tests.engine.helpers import make_resource, random_batch
from trainer.contract.specs import AdamParams, LossConfig, SessionSpec


def test_worker_logs_offline_run(tiny_qwen_dir, tmp_path, monkeypatch) -> None:
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    resource = make_resource(tiny_qwen_dir, tmp_path)
    spec = SessionSpec(metadata={"wandb": {"project": "trainer-test", "run_id": "r42"}})
    session = resource.create_session("s", spec)
    assert session.tracker is not None
    history = []
    real_log = session.tracker.handle.log
    session.tracker.handle.log = lambda data, step: (
        history.append((step, data)),
        real_log(data, step=step),
    )
    session.forward_backward(LossConfig(type="cross_entropy"), random_batch(0, weights="ones"))
    session.optim_step(AdamParams())
    resource.close_session("s")
    assert history[0][0] == 0 and "train/loss" in history[0][1]
    assert history[1][0] == 1 and "optim/grad_norm" in history[1][1]
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*r42-worker")
    assert list(run_dir.glob("*.wandb"))
    assert wandb.run is None  # finished with the session


def test_no_metadata_no_run(tiny_qwen_dir, tmp_path) -> None:
    resource = make_resource(tiny_qwen_dir, tmp_path)
    assert resource.create_session("s", SessionSpec()).tracker is None
