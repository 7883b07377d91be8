"""The operation table (`trainer.serving.operations`) is the one place an operation is declared.

The HTTP routes, rank 0's SPMD proxy (`DistributedSession`) and the per-rank dispatch are all
derived from it: every entry has its POST/GET pair and its proxy/dispatch path, and a new entry
gets routes and an SPMD path with no other code. The SPMD half runs the real command stream
(`Spmd` over a one-rank gloo group) against a session driven directly with the same inputs.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from api_helpers import SEQUENCES, ce_sample
from conftest import LiveServer, free_port
from fastapi import APIRouter
from test_http import CE, TERMINAL, new_resource, new_session, output

from tests.engine.helpers import make_resource, model_input, random_batch
from trainer.api.rl import routes_ops
from trainer.checkpoint.store import CheckpointRecord
from trainer.contract.embeddings import EmbeddingObjective
from trainer.contract.specs import (
    AdamParams,
    Gradient,
    LoraConfig,
    LossConfig,
    Sample,
    SamplingParams,
    SessionSpec,
    TensorData,
)
from trainer.distributed import spmd as spmd_module
from trainer.distributed.comm import Comm
from trainer.distributed.spmd import DistributedSession, Spmd
from trainer.engine.session import TrainingSession
from trainer.serving.operations import METHODS, OPERATIONS, Operation
from trainer.serving.requests import EmptyBody, ForwardBackwardBody

OPS = "/v1/rl/training-sessions/{session_id}/operations"
CE_LOSS = LossConfig(type="LOSS_TYPE_CROSS_ENTROPY")


def _forward_only(body: ForwardBackwardBody) -> dict[str, Any]:
    return {"loss": body.loss, "samples": body.samples, "forward_only": True}


# a new operation: scores samples without touching the gradients; nothing else declares it
SCORE = Operation(
    "score",
    ForwardBackwardBody,
    "forward_backward",
    _forward_only,
    wire=lambda call: {"score": -call()["loss"]},
)


def test_every_entry_has_its_routes(server: LiveServer) -> None:
    paths = server.app.openapi()["paths"]
    kinds = {p[len(OPS) + 1 :].split("/")[0] for p in paths if p.startswith(OPS + "/")}
    assert kinds == {kind for kind, op in OPERATIONS.items() if op.rl_face}
    assert "embedding-forward-backward" not in kinds  # the Tinker face's only (semantics §27)
    for kind, op in OPERATIONS.items():
        if not op.rl_face:
            continue
        post = paths[f"{OPS}/{kind}"]["post"]
        assert set(paths[f"{OPS}/{kind}/{{operation_id}}"]) == {"get"}
        assert post["operationId"].startswith(f"create_{kind.replace('-', '_')}")
        assert [p["name"] for p in post["parameters"]][-1] == "Idempotency-Key"
        body = post["requestBody"]
        assert body["required"] is (op.body is not EmptyBody)
        schema = body["content"]["application/json"]["schema"]
        assert schema["title"] == op.body.__name__
        assert set(schema.get("properties", {})) == set(op.body.model_fields)


def test_a_new_entry_gets_routes_and_runs(server: LiveServer) -> None:
    """One table entry, registered the way `routes_ops` registers the table: POST, polling GET,
    validation naming the field; its arguments from `args`, its result shaped by `wire`."""
    router = APIRouter()
    routes_ops.add_routes(router, SCORE)
    server.app.include_router(router, prefix="/v1")
    samples = [ce_sample(s) for s in SEQUENCES]
    with server.client() as http:
        sid = new_session(http, new_resource(http))
        url = f"/rl/training-sessions/{sid}/operations/score"
        response = http.post(
            url, json={"loss": CE, "samples": samples}, headers={"Idempotency-Key": "k1"}
        )
        assert response.status_code == 200, response.text
        op = response.json()
        while op["status"] not in TERMINAL:
            op = http.get(f"{url}/{op['id']}").json()
        assert op["status"] == TERMINAL[0], op
        assert http.get(f"{url}/{op['id']}").json()["output"] == op["output"]
        # forward only (from `args`): no gradient was accumulated
        step = output(http, sid, "optim-step", {"adam_params": {"learning_rate": 0.0}})
        assert step["metrics"]["grad_norm"] == 0.0
        forward = output(http, sid, "forward-backward", {"loss": CE, "samples": samples})
        assert op["output"] == {"score": -forward["loss"]}
        bad = http.post(url, json={"loss": CE}, headers={"Idempotency-Key": str(uuid.uuid4())})
        assert bad.status_code == 400, bad.text
        assert bad.json()["error"]["param"] == "samples"


# a new operation with an engine method of its own (`ScoringSession.score`)
SCORE_SPMD = Operation("score", ForwardBackwardBody, "score", lambda b: {"samples": b.samples})


@pytest.fixture
def one_rank() -> Iterator[Comm]:
    """A real one-rank gloo job in this process (the same groups `init_distributed` makes)."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        world = dist.group.WORLD
        yield Comm(0, 1, torch.device("cpu"), world, world, world, world)
    finally:
        dist.destroy_process_group()


class ScoringSession(TrainingSession):
    """An engine with one more method, for the new table entry `SCORE_SPMD`."""

    def score(self, samples: list[Sample], scale: float = 1.0) -> dict[str, Any]:
        out = self.forward_backward(CE_LOSS, samples)
        return {"score": -scale * out["loss"]}


def _saved(record: CheckpointRecord) -> tuple[str, int, set[str]]:
    return record.type, record.step, {p.name for p in record.path.iterdir()}


def _drive(session: Any) -> dict[str, Any]:
    """Every table method once; positional and keyword arguments, a packed-array sample."""
    batch = random_batch(3, n=3, weights="ones")
    weights = batch[0].loss_fn_inputs["weights"]
    batch[0].loss_fn_inputs["weights"] = TensorData(
        data=np.asarray(weights.data, dtype=np.float64), dtype="float32"
    )
    gradients = [Gradient(data=[0.1] * len(s.model_input.tokens)) for s in batch]
    prompt = model_input([5, 6, 7])
    out = {
        "forward_backward": session.forward_backward(CE_LOSS, batch),
        "custom_forward_backward": session.custom_forward_backward(batch, gradients=gradients),
        "embedding_forward_backward": session.embedding_forward_backward(
            [Sample(model_input=s.model_input) for s in batch],
            EmbeddingObjective(output="cos_similarity_matrix", pooling="last"),
            gradients=[Gradient(data=[0.5, -0.5, 0.25])] * 3,
        ),
        "optim_step": session.optim_step(AdamParams(learning_rate=1e-2)),
        "weights_sync": session.weights_sync("WEIGHT_SYNC_TYPE_SYNCHRONOUS"),
        "sample": session.sample(
            [prompt], num_samples=2, sampling_params=SamplingParams(max_tokens=4, seed=3)
        ),
        "save_training_checkpoint": _saved(session.save_training_checkpoint()),
        "save_inference_checkpoint": _saved(session.save_inference_checkpoint()),
        "score": session.score(batch[:2], scale=2.0),
    }
    out["forward_again"] = session.forward_backward(CE_LOSS, batch, forward_only=True)
    return out


def test_proxy_and_dispatch_follow_the_table(
    one_rank: Comm, tiny_qwen_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0's proxy forwards each table method (and a new entry's) through the real command
    stream as JSON, every rank dispatches it by name, and the outcome equals a direct call."""
    monkeypatch.setattr(spmd_module, "SESSION_METHODS", {*spmd_module.SESSION_METHODS, "score"})
    resource = make_resource(tiny_qwen_dir, tmp_path)
    spec = SessionSpec(lora_config=LoraConfig(rank=4, seed=0))
    direct = resource.create_session("direct", spec)
    proxied = resource.create_session("proxied", spec)
    direct.__class__ = proxied.__class__ = ScoringSession
    spmd = Spmd(one_rank)
    spmd.executor.resources["r"] = resource  # type: ignore[assignment]
    commands: list[dict[str, Any]] = []
    send = one_rank.broadcast_json

    def recording(obj: Any = None, group: Any = None) -> Any:
        if isinstance(obj, dict) and "session" in obj:  # a session command, as plain JSON
            commands.append(json.loads(json.dumps(obj)))
        return send(obj, group=group)

    monkeypatch.setattr(one_rank, "broadcast_json", recording)
    try:
        via_proxy = _drive(DistributedSession(spmd, "r", proxied))
        expected = _drive(direct)
    finally:
        resource.close()
    assert via_proxy == expected
    assert [c["op"] for c in commands] == [*METHODS, "score", "forward_backward"]
    assert commands[-1]["args"]["forward_only"] is True
    assert commands[-2]["args"] == {"samples": commands[0]["args"]["samples"][:2], "scale": 2.0}
