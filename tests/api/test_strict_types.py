"""Strict types on the RL face's bodies: a boolean is a JSON boolean and a number a JSON number.
"yes", "no", "1", 1 and 0 for a boolean, a string or a float for an integer, a string for a
float: each is a 400 naming the field, never coerced (`forward_only: "no"` does not turn a
forward-backward into a forward). The int64 fields protobuf's JSON sends as decimal strings
(token ids, seeds) still take them, as the `together` SDK tests show.

Everything goes over TCP to the real app and engine (`serve_in_thread`)."""

from __future__ import annotations

import copy
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.conftest import LiveServer, serve_in_thread
from tests.faults.procs import ce_sample, model_input, new_resource, new_session, run_op

OPS = "/rl/training-sessions/{sid}/operations"
FB = {"loss": {"type": "LOSS_TYPE_CROSS_ENTROPY"}, "samples": [ce_sample([1, 2, 3, 4])]}
SAMPLE = {"model_inputs": [model_input([1, 2])], "sampling_params": {"max_tokens": 2}}
SESSION: dict[str, Any] = {"lora_config": {"rank": 2, "seed": 0}}
RESOURCE = {"base_model": "tiny-qwen"}

# (route, body, the dotted path set, the value, the field named)
COERCED: list[tuple[str, dict[str, Any], str, Any]] = [
    *((f"{OPS}/forward-backward", FB, "forward_only", v) for v in ("no", "false", 1, 0)),
    (f"{OPS}/forward-backward", FB, "return_loss_fn_outputs", "yes"),
    (f"{OPS}/forward-backward", FB, "samples.0.loss_fn_inputs.weights.data.1", "1.0"),
    *((f"{OPS}/sample", SAMPLE, "num_samples", v) for v in ("2", 2.0, True)),
    (f"{OPS}/sample", SAMPLE, "sampling_params.max_tokens", "2"),
    (f"{OPS}/sample", SAMPLE, "sampling_params.max_tokens", 2.5),
    (f"{OPS}/sample", SAMPLE, "sampling_params.temperature", "1.0"),
    (f"{OPS}/sample", SAMPLE, "sampling_params.top_p", True),
    (f"{OPS}/sample", SAMPLE, "prompt_logprobs", 0),
    (f"{OPS}/sample", SAMPLE, "return_routed_experts", "yes"),
    (f"{OPS}/sample", SAMPLE, "topk_prompt_logprobs", "1"),
    ("/rl/training-sessions", SESSION, "lora_config.rank", "2"),
    ("/rl/training-sessions", SESSION, "lora_config.train_unembed", "no"),
    ("/rl/training-sessions", SESSION, "lora_config.dropout", "0.1"),
    ("/rl/training-sessions", SESSION, "load_optimizer", 1),
    ("/rl/model-resources", RESOURCE, "lora_enabled", "yes"),
    ("/rl/model-resources", RESOURCE, "inactive_timeout", "3600"),
    ("/rl/model-resources", RESOURCE, "inactive_timeout", 3600.0),
    ("/rl/model-resources/{rid}/extend-expiry", {"seconds": 600}, "seconds", "600"),
    ("/rl/model-resources/{rid}/stop", {"force": False}, "force", "false"),
]


@pytest.fixture(scope="module")
def live(tiny_qwen_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    storage = tmp_path_factory.mktemp("strict") / "storage"
    with serve_in_thread(storage, {"tiny-qwen": tiny_qwen_dir}) as server, server.client() as http:
        rid = new_resource(http, "tiny-qwen")
        sid = new_session(http, rid, **SESSION)
        yield server, http, rid, sid


def _with(body: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(body)
    *parents, last = path.split(".")
    node: Any = out
    for part in parents:
        node = node[int(part)] if part.isdigit() else node.setdefault(part, {})
    node[int(last) if last.isdigit() else last] = value
    return out


def _field(path: str) -> str:
    """The dotted path as the error names it: `samples.0.x` -> `samples[0].x`."""
    out = ""
    for part in path.split("."):
        out += f"[{part}]" if part.isdigit() else (f".{part}" if out else part)
    return out


@pytest.mark.parametrize(("route", "body", "path", "value"), COERCED)
def test_a_coerced_value_is_a_400_naming_the_field(
    live: tuple[LiveServer, httpx.Client, str, str],
    route: str,
    body: dict[str, Any],
    path: str,
    value: Any,
) -> None:
    server, http, rid, sid = live
    sent = _with(body, path, value)
    if route == "/rl/training-sessions":
        sent["model_resources_id"] = rid
    url = route.format(rid=rid, sid=sid)
    response = http.post(url, json=sent, headers={"Idempotency-Key": str(uuid.uuid4())})
    assert response.status_code == 400, (path, value, response.status_code, response.text[:300])
    error = response.json()["error"]
    field = _field(path)
    assert error["param"].startswith(field.rsplit(".data", 1)[0]), (field, error)
    assert field.rsplit(".", 1)[-1].split("[")[0] in error["message"], (field, error)
    assert int(server.worker.sessions[sid].engine.step) == 0  # nothing reached the session


def test_int64_fields_still_take_decimal_strings(
    live: tuple[LiveServer, httpx.Client, str, str],
) -> None:
    _, http, _, sid = live
    fb = copy.deepcopy(FB)
    sample = fb["samples"][0]
    tokens = sample["model_input"]["chunks"][0]["encoded_text"]["tokens"]
    sample["model_input"]["chunks"][0]["encoded_text"]["tokens"] = [str(t) for t in tokens]
    targets = sample["loss_fn_inputs"]["target_tokens"]
    targets["data"] = [str(t) for t in targets["data"]]
    done = run_op(http, sid, "forward-backward", {**fb, "forward_only": True})
    assert done["status"] == "TRAINING_OPERATION_STATUS_COMPLETED", done
    seeded = _with(SAMPLE, "sampling_params.seed", "12345678901234567")
    done = run_op(http, sid, "sample", seeded)
    assert done["status"] == "TRAINING_OPERATION_STATUS_COMPLETED", done
