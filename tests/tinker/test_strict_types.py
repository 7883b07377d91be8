"""Strict types on the Tinker face's JSON bodies: a boolean is a JSON boolean and a number a JSON
number. "yes", "no", 1 and 0 for a boolean, a string or a float for an integer, a string for a
float: each is a 400 naming the Tinker field, and leaves no future or trace
(`forward_only: "no"` never turns a forward-backward into a forward). The official SDK's own
bodies keep working (`tests/tinker/test_sdk.py`).

Everything goes over TCP to the real app and engine (`serve_in_thread`)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.conftest import LiveServer, serve_in_thread
from tests.tinker import tinker_http as th

MODEL = "{model}"
SESSION = "{session}"
SAMPLE = {"base_model": th.BASE, "prompt": th.datum()["model_input"], "sampling_params": {}}
CREATE = {"session_id": SESSION, "model_seq_id": 9, "base_model": th.BASE}

# (route, body, the dotted path set, the value); the field named is the path
COERCED: list[tuple[str, dict[str, Any], str, Any]] = [
    *(("/forward_backward", th.fb_body(MODEL), "forward_only", v) for v in ("no", "false", 1, 0)),
    ("/forward_backward", th.fb_body(MODEL), "seq_id", "3"),
    ("/forward_backward", th.fb_body(MODEL), "seq_id", 3.0),
    (
        "/forward_backward",
        {**th.fb_body(MODEL), "forward_backward_input": {"data": [th.datum()], "loss_fn": "dro"}},
        "forward_backward_input.loss_fn_config.beta",
        "0.1",
    ),
    ("/optim_step", th.optim_body(MODEL), "adam_params.learning_rate", "1e-4"),
    ("/optim_step", th.optim_body(MODEL), "adam_params.beta1", True),
    *(("/asample", SAMPLE, "prompt_logprobs", v) for v in ("yes", 1, 0)),
    *(("/asample", SAMPLE, "num_samples", v) for v in ("2", 2.0, True)),
    ("/asample", SAMPLE, "topk_prompt_logprobs", "1"),
    ("/asample", SAMPLE, "sampling_params.max_tokens", "4"),
    ("/asample", SAMPLE, "sampling_params.temperature", "1.0"),
    ("/asample", SAMPLE, "sampling_params.seed", 1.5),
    ("/create_model", CREATE, "model_seq_id", "9"),
    ("/create_model", CREATE, "model_seq_id", 9.0),
    ("/create_model", {**CREATE, "lora_config": {"rank": 2}}, "lora_config.rank", "2"),
    ("/create_model", {**CREATE, "lora_config": {"rank": 2}}, "lora_config.train_unembed", "no"),
    ("/retrieve_future", {"request_id": "x"}, "allow_metadata_only", "yes"),
]


@pytest.fixture(scope="module")
def live(tiny_qwen_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    storage = tmp_path_factory.mktemp("tinker-strict")
    model = [{"name": th.BASE, "location": str(tiny_qwen_dir)}]
    with serve_in_thread(storage, {}, model=model) as server:
        yield server


def _filled(value: Any, model: str) -> Any:
    """`value` with the model and its session put in the placeholders."""
    if isinstance(value, dict):
        return {k: _filled(v, model) for k, v in value.items()}
    if isinstance(value, list):
        return [_filled(v, model) for v in value]
    if value == MODEL:
        return model
    return model.split(":")[0] if value == SESSION else value


def _with(body: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(body)
    *parents, last = path.split(".")
    node = out
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return out


@pytest.mark.parametrize(("route", "body", "path", "value"), COERCED)
def test_a_coerced_value_is_a_400_naming_the_tinker_field(
    live: LiveServer, http: httpx.Client, model: str, route: str, body: Any, path: str, value: Any
) -> None:
    before, records = th.fingerprint(live, model), th.records(live)
    response = http.post(route, json=_with(_filled(body, model), path, value))
    assert response.status_code == 400, (path, value, response.status_code, response.text[:300])
    error = response.json()["error"]
    assert error["param"] == path and error["message"].startswith(f"{path}: "), error
    assert th.records(live) == records, "a refused request left a future or a record"
    assert th.fingerprint(live, model) == before


def test_forward_only_false_trains(live: LiveServer, http: httpx.Client, model: str) -> None:
    """The JSON booleans keep their meaning: false runs the backward, true does not."""
    step = th.engine_step(live, model)
    th.ok(http, "/forward_backward", th.fb_body(model, forward_only=True))
    th.ok(http, "/forward_backward", th.fb_body(model, forward_only=False))
    th.ok(http, "/optim_step", th.optim_body(model))
    assert th.engine_step(live, model) == step + 1
