"""W&B logging from session metadata, offline (no API key, no network)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.engine.tracking import open_run, wandb_settings


def test_no_wandb_metadata_means_no_run() -> None:
    assert open_run(None, {}) is None
    assert open_run({}, {}) is None
    assert open_run({"wandb": None}, {}) is None
    assert wandb_settings({"wandb": {"project": "", "entity": None}}) is None
    assert wandb_settings({"wandb": {"project": "p", "url": None}}) == {"project": "p"}


def test_offline_run_writes_locally(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    metadata = {"wandb": {"project": "trainer-test", "run_name": "offline", "run_id": "abc123"}}
    run = open_run(metadata, {"loop": {"learning_rate": 1e-3}}, directory=str(tmp_path))
    assert run is not None
    for step in (1, 2, 3):
        run.log(step, {"reward/mean": 0.1 * step, "loss": float("nan"), "ok": True, "name": "x"})
    run.finish()
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*abc123")
    assert list(run_dir.glob("*.wandb"))
