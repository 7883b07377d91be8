"""A Tinker model is loaded again in place after a restart and after its shared resource was
stopped (any token holder can stop it through `/v1`): `load_state` with the model's own id,
as the refusal and the restart's failure message say, runs on a fresh resource and restores
the saved weights; new models and samplers work too."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np

from tests.api.conftest import LiveServer, serve_in_thread
from tests.tinker import tinker_http as th
from trainer.api.tinker.records import TinkerModel


def trained_and_saved(http: httpx.Client) -> tuple[str, str, list[float]]:
    """A model after one step, its `save_state` path and its logprobs there."""
    model = th.new_model(http)
    th.ok(http, "/forward_backward", th.fb_body(model))
    th.ok(http, "/optim_step", th.optim_body(model))
    path: str = th.ok(http, "/save_weights", {"model_id": model, "path": "step1"})["path"]
    return model, path, th.forward(http, model)


def reloads_in_place(
    http: httpx.Client, model: str, path: str, expected: list[float], seq_id: int = 100
) -> None:
    """The model is not loaded (a 400 that says to load it); `load_state` with its own id
    (the SDK's next `seq_id`) brings it back with the saved weights, and it trains on."""
    response = http.post("/forward_backward", json=th.fb_body(model, True))
    th.check_refusal(response, "model_id")
    assert "no longer loaded" in response.text
    body = {"model_id": model, "path": path, "optimizer": True, "seq_id": seq_id}
    assert th.ok(http, "/load_weights", body)["model_id"] == model
    np.testing.assert_allclose(th.forward(http, model), expected, rtol=0, atol=1e-6)
    th.ok(http, "/forward_backward", th.fb_body(model))
    assert "metrics" in th.ok(http, "/optim_step", th.optim_body(model))


def new_model_and_sampler_work(http: httpx.Client, path: str) -> None:
    fresh = th.new_model(http, model_id_session(path), seq=50)
    assert len(th.forward(http, fresh)) == len(th.TOKENS) - 1
    sampler = th.ok(http, "/save_weights_for_sampler", {"model_id": fresh, "path": "s"})["path"]
    body = {
        "model_path": sampler,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
        "sampling_params": {"max_tokens": 2, "seed": 0},
    }
    assert len(th.ok(http, "/asample", body)["sequences"]) == 1


def model_id_session(path: str) -> str:
    """The Tinker session of the model a `tinker://<model>/...` path was saved under."""
    return path.removeprefix("tinker://").split(":")[0]


def test_load_state_in_place_after_a_restart(tiny_qwen_dir: Path, tmp_path: Path) -> None:
    storage, models = tmp_path / "storage", {th.BASE: tiny_qwen_dir}
    with serve_in_thread(storage, models) as first, th.client(first) as http:
        model, path, expected = trained_and_saved(http)
    with serve_in_thread(storage, models) as second, th.client(second) as http:
        reloads_in_place(http, model, path, expected)
        new_model_and_sampler_work(http, path)


def stop_the_shared_resource(live: LiveServer, model: str) -> None:
    record = live.app.state.tinker.db.get(TinkerModel, model)
    assert record is not None
    with live.client() as rl:
        response = rl.post(f"/rl/model-resources/{record.resource_id}/stop", json={"force": True})
        assert response.status_code == 200, response.text
        assert response.json()["status"] == "MODEL_RESOURCES_STATUS_STOPPED"


def test_load_state_in_place_after_the_resource_was_stopped(
    tiny_qwen_dir: Path, tmp_path: Path
) -> None:
    with (
        serve_in_thread(tmp_path / "storage", {th.BASE: tiny_qwen_dir}) as live,
        th.client(live) as http,
    ):
        model, path, expected = trained_and_saved(http)
        base_sample = th.valid_bodies(http, model)["/asample"]
        assert "sequences" in th.ok(http, "/asample", base_sample)  # a sampler session is open
        stop_the_shared_resource(live, model)
        reloads_in_place(http, model, path, expected)
        new_model_and_sampler_work(http, path)
        assert "sequences" in th.ok(http, "/asample", base_sample)
        # and once more: the resource the face made again can be stopped and replaced too
        stop_the_shared_resource(live, model)
        reloads_in_place(http, model, path, expected, seq_id=101)
