"""Plain-httpx helpers for the Tinker face, shared by the guarantee and fuzz tests.

They speak the wire as the SDK does (JSON bodies of tinker 0.38's `types/`, `X-API-Key`,
futures polled through `retrieve_future`) without the SDK, so a test can send what the SDK
never would. In-process reads (`fingerprint`, `engine_step`) look at the real engine objects of
a worker served in a thread, to prove that a refused request left no trace.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import torch

from tests.api.conftest import TOKEN, LiveServer
from trainer.api.tinker import proto
from trainer.api.tinker.protowire import write_message
from trainer.api.tinker.records import (
    TinkerCheckpoint,
    TinkerFuture,
    TinkerModel,
    TinkerSampler,
    TinkerSession,
)

PREFIX = "/api/v1"
BASE = "tiny-qwen"
TOKENS = [3, 17, 42, 9, 77, 5]


def mounted_routes(routes: list[Any], prefix: str = "") -> Iterator[tuple[str, str]]:
    """(method, path) of every route, through included routers (FastAPI >= 0.165 keeps an
    included router as one `_IncludedRouter` entry, with its prefix in `include_context`)."""
    for route in routes:
        included = getattr(route, "original_router", None)
        if included is not None:
            yield from mounted_routes(included.routes, prefix + route.include_context.prefix)
            continue
        path = prefix + getattr(route, "path", "")
        for method in sorted(getattr(route, "methods", None) or ()):
            if method != "HEAD":
                yield method, path


def face_routes(app: Any) -> list[tuple[str, str]]:
    """(method, path) of every route mounted under /api/v1."""
    return [(m, p) for m, p in mounted_routes(app.routes) if p.startswith(PREFIX)]


def client(live: LiveServer, timeout: float = 60, **headers: str) -> httpx.Client:
    sent = headers or {"X-API-Key": f"tml-{TOKEN}"}
    return httpx.Client(base_url=f"{live.url}{PREFIX}", headers=sent, timeout=timeout)


def wait(http: httpx.Client, request_id: str, timeout: float = 120) -> dict[str, Any]:
    """Poll `retrieve_future` as the SDK does until the request settles: its result, or the
    `{"error", "category"}` of a failed one."""
    deadline = time.monotonic() + timeout
    while True:
        response = http.post("/retrieve_future", json={"request_id": request_id})
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        if body.get("type") != "try_again":
            return body
        assert time.monotonic() < deadline, f"{request_id} never settled"


def ok(http: httpx.Client, path: str, body: dict[str, Any], **headers: str) -> dict[str, Any]:
    """POST a request that answers a future, and wait for its (successful) result."""
    response = http.post(path, json=body, headers=headers)
    assert response.status_code == 200, (path, response.text)
    result = wait(http, response.json()["request_id"])
    assert "error" not in result, (path, result)
    return result


def new_session(http: httpx.Client) -> str:
    response = http.post("/create_session", json={"tags": [], "sdk_version": "0.38.0"})
    assert response.status_code == 200, response.text
    session_id: str = response.json()["session_id"]
    return session_id


def new_model(http: httpx.Client, session_id: str | None = None, seq: int = 0) -> str:
    session_id = session_id or new_session(http)
    body = {
        "session_id": session_id,
        "model_seq_id": seq,
        "base_model": BASE,
        "lora_config": {"rank": 2, "seed": 0},
    }
    model_id: str = ok(http, "/create_model", body)["model_id"]
    return model_id


def tensor(values: list[float] | list[int], dtype: str) -> dict[str, Any]:
    return {"data": list(values), "dtype": dtype, "shape": [len(values)]}


def datum(tokens: list[int] = TOKENS) -> dict[str, Any]:
    """A cross-entropy datum: predict each next token of `tokens`."""
    inputs, targets = tokens[:-1], tokens[1:]
    return {
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": inputs}]},
        "loss_fn_inputs": {
            "target_tokens": tensor(targets, "int64"),
            "weights": tensor([1.0] * len(targets), "float32"),
        },
    }


def fb_body(model_id: str, forward_only: bool = False, seq_id: int | None = None) -> dict:
    body: dict[str, Any] = {
        "model_id": model_id,
        "forward_backward_input": {"data": [datum()], "loss_fn": "cross_entropy"},
        "forward_only": forward_only,
    }
    if seq_id is not None:
        body["seq_id"] = seq_id
    return body


def fb_proto(model_id: str, seq_id: int = 7) -> bytes:
    """`fb_body(model_id)` as the SDK's protobuf `ForwardBackwardRequest`."""
    inputs, targets = TOKENS[:-1], TOKENS[1:]
    n = len(targets)
    msg = {
        "model_id": model_id,
        "seq_id": seq_id,
        "loss_fn": "cross_entropy",
        "data": [
            {
                "model_input": [{"encoded_text": {"tokens": np.array(inputs, "<i4").tobytes()}}],
                "loss_fn_inputs": {
                    "target_tokens": {
                        "dense": np.array(targets, "<i8").tobytes(),
                        "dtype": proto.DTYPE_INT64,
                        "shape": [n],
                    },
                    "weights": {
                        "dense": np.ones(n, "<f4").tobytes(),
                        "dtype": proto.DTYPE_FLOAT32,
                        "shape": [n],
                    },
                },
            }
        ],
    }
    return write_message(msg, proto.FORWARD_BACKWARD_REQUEST)


def optim_body(model_id: str, seq_id: int | None = None, lr: float = 1e-2) -> dict[str, Any]:
    body: dict[str, Any] = {"model_id": model_id, "adam_params": {"learning_rate": lr}}
    if seq_id is not None:
        body["seq_id"] = seq_id
    return body


def logprobs(result: dict[str, Any]) -> list[float]:
    out: list[float] = result["loss_fn_outputs"][0]["logprobs"]["data"]
    return out


def forward(http: httpx.Client, model_id: str) -> list[float]:
    return logprobs(ok(http, "/forward_backward", fb_body(model_id, forward_only=True)))


def valid_bodies(
    http: httpx.Client, model: str, victim: str | None = None
) -> dict[str, dict[str, Any]]:
    """A valid body for each POST route that takes one (ids of live records). `victim`: the
    model that `load_weights` and `unload_model` name (default `model`)."""
    victim = victim or model
    session = http.get(f"/training_runs/{model}").json()
    assert session["training_run_id"] == model
    tinker_session = model.split(":")[0]
    saved = ok(http, "/save_weights", {"model_id": model, "path": "valid", "overwrite": True})[
        "path"
    ]
    return {
        "/create_session": {"tags": ["a"], "user_metadata": {"k": "v"}, "sdk_version": "0.38.0"},
        "/session_heartbeat": {"session_id": tinker_session},
        "/create_model": {
            "session_id": tinker_session,
            "model_seq_id": 99,
            "base_model": BASE,
            "lora_config": {"rank": 2, "seed": 0},
        },
        "/get_info": {"model_id": model},
        "/weights_info": {"tinker_path": saved},
        "/retrieve_future": {"request_id": "req_x"},
        "/forward_backward": fb_body(model, seq_id=7),
        "/forward": {
            "model_id": model,
            "forward_input": {"data": [datum()], "loss_fn": "cross_entropy"},
            "seq_id": 7,
        },
        # (no adapter there: a 400 naming adapter_path, once the model is found)
        "/load_adapter": {"model_id": victim, "adapter_path": "/no-such-adapter", "seq_id": 7},
        "/optim_step": optim_body(model, seq_id=7),
        "/save_weights": {"model_id": model, "path": "p", "seq_id": 7},
        "/save_weights_for_sampler": {"model_id": model, "path": "p", "seq_id": 7},
        "/save_weights_external": {"model_id": model, "path": "p", "seq_id": 7},
        "/load_weights": {"model_id": victim, "path": saved, "optimizer": True, "seq_id": 7},
        "/unload_model": {"model_id": victim},
        "/copy_weights": {"source_path": saved, "destination_project_id": "p"},
        "/create_sampling_session": {
            "session_id": tinker_session,
            "sampling_session_seq_id": 3,
            "base_model": BASE,
        },
        "/asample": {
            "base_model": BASE,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
            "num_samples": 1,
            "sampling_params": {"max_tokens": 2, "seed": 0},
        },
    }


def engine_session(live: LiveServer, model_id: str) -> Any:
    model = live.app.state.tinker.db.get(TinkerModel, model_id)
    assert model is not None, model_id
    return live.worker.sessions[model.session_id].engine


def engine_step(live: LiveServer, model_id: str) -> int:
    return int(engine_session(live, model_id).step)


def fingerprint(live: LiveServer, model_id: str) -> tuple[int, str]:
    """(step, sha256 of every trainable tensor and its gradient) of the model's session."""
    session = engine_session(live, model_id)
    digest = hashlib.sha256()
    with session.resource.lock:
        for name, param in sorted(session.policy.trainable.items()):
            digest.update(name.encode())
            digest.update(param.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
            if param.grad is not None:
                grad = param.grad.detach().cpu().contiguous()
                digest.update(grad.view(torch.uint8).numpy().tobytes())
        return int(session.step), digest.hexdigest()


def records(live: LiveServer) -> dict[str, int]:
    """How many records of each kind the Tinker face holds, and how many engine sessions and
    checkpoints the worker holds (a refused request adds none)."""
    db = live.app.state.tinker.db
    kinds = (TinkerSession, TinkerModel, TinkerFuture, TinkerCheckpoint, TinkerSampler)
    out = {kind.__name__: db.count(kind) for kind in kinds}
    out["engine sessions"] = len(live.worker.sessions)
    out["engine checkpoints"] = len(list(live.worker.checkpoints.list(limit=1_000_000)))
    return out


def check_refusal(response: httpx.Response, field: str | None = None) -> None:
    """A 4xx in the service's error shape whose message names its `param` (or `field`)."""
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:500])
    error = response.json()["error"]
    message, param = error["message"], error["param"]
    assert isinstance(message, str) and message, error
    if field is not None:
        assert field in message, (field, error)
    if param and param not in ("body", "path", "method"):  # those name the whole request
        head = param.split(".")[0].split("[")[0]
        assert head in message, f"the message does not name {param}: {error}"
