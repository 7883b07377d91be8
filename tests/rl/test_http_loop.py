"""The loop over HTTP with the official SDK, one step off-policy (BACKGROUND_PUBLISH).

The worker runs in this process (uvicorn in a thread, the real app and engine), so the test
is quick; `test_demo.py` covers the child-process worker that `trainer demo` starts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainer.rl.client import HttpClient
from trainer.rl.config import Recipe
from trainer.rl.loop import RLLoop
from trainer.rl.tasks import make_task

TOKEN = "rl-test-token-0123456789"


@pytest.fixture(scope="module")
def server_url(digits_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    import uvicorn

    from trainer.api.app import create_app
    from trainer.serving.config import ServeConfig
    from trainer.serving.worker import Worker
    from trainer.spawn import free_port

    port = free_port()
    config = ServeConfig.model_validate(
        {
            "port": port,
            "storage": tmp_path_factory.mktemp("worker"),
            "model": [{"name": "tiny-digits", "location": str(digits_model_dir)}],
            "device": "cpu",
        }
    )
    server = uvicorn.Server(
        uvicorn.Config(create_app(Worker(config), TOKEN), port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the worker did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/v1"
    server.should_exit = True
    thread.join(60)


def test_off_policy_over_http(server_url: str) -> None:
    recipe = Recipe.model_validate(
        {
            "task": {"length": 3},
            "loop": {"mode": "off_policy", "steps": 4, "prompts_per_step": 4, "group_size": 4},
        }
    )
    client = HttpClient(server_url, TOKEN, base_model="tiny-digits", lora=False)
    try:
        history = RLLoop(client, make_task(recipe.task), recipe).run()
        assert [m["weights_version"] for m in history] == [1, 2, 3, 4]
        assert [m["version/sampled_min"] for m in history] == [0, 0, 1, 2]
        assert [m["version/staleness"] for m in history] == [0, 1, 1, 1]
        state = client.session.retrieve().policy_state
        assert int(state.target_weights_version) == 4 and state.pending_publish
    finally:
        client.close()


def test_lora_sft_over_http(server_url: str) -> None:
    recipe = Recipe.model_validate(
        {
            "resource": {"lora": True, "lora_rank": 4},
            "task": {"length": 3},
            "loop": {"objective": "sft", "steps": 3, "prompts_per_step": 8, "group_size": 1},
        }
    )
    lora = {"rank": 4, "alpha": 8, "train_unembed": True, "seed": 0}
    client = HttpClient(server_url, TOKEN, base_model="tiny-digits", lora=True, lora_config=lora)
    try:
        loop = RLLoop(client, make_task(recipe.task), recipe)
        history = loop.run()
        assert [m["weights_version"] for m in history] == [1, 2, 3]
        assert all(m["samples"] == 8 and m["loss"] > 0 for m in history)
        assert 0.0 <= loop.evaluate(4) <= 1.0
        training_id, inference_id = client.checkpoints()
        assert training_id and inference_id
    finally:
        client.close()
