"""`base_weights_ref` over HTTP, driven by the official SDK: a full-weight resource created from
an inference checkpoint serves that checkpoint's merged model; bad refs are a 400 naming it."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from api_helpers import SEQUENCES, ce_sample, load_causal_lm, reference_logprobs
from conftest import TOKEN, LiveServer
from together.post_training import ModelResourcesClient, SessionClient

CE = {"type": "LOSS_TYPE_CROSS_ENTROPY"}
FIELD = "base_weights_ref"


def _logprobs(session: SessionClient) -> list[list[float]]:
    out = session.trainer.forward(samples=[ce_sample(s) for s in SEQUENCES], loss=CE)
    assert out.loss_fn_outputs is not None
    return [list(o.tensors["logprobs"].data) for o in out.loss_fn_outputs]


def _resource(server: LiveServer, base_model: str, **extra: object) -> ModelResourcesClient:
    return ModelResourcesClient.create(
        api_key=TOKEN,
        base_url=server.api,
        base_model=base_model,
        inactive_timeout=600,
        interval=0.05,
        **extra,  # type: ignore[arg-type]
    )


def _checkpoints(server: LiveServer) -> tuple[str, str, str]:
    """(an inference checkpoint of tiny-qwen after a LoRA step, a training checkpoint of it,
    an inference checkpoint of tiny-llama)."""
    with _resource(server, "tiny-qwen", lora_enabled=True) as resource:
        session = resource.create_session(lora_config={"rank": 4, "seed": 1}, interval=0.05)
        session.trainer.forward_backward(samples=[ce_sample(s) for s in SEQUENCES], loss=CE)
        session.trainer.optim_step(adam_params={"learning_rate": 5e-2})
        inference = session.create_inference_checkpoint().id
        training = session.create_training_checkpoint().id
        session.stop()
    with _resource(server, "tiny-llama", lora_enabled=False) as resource:
        session = resource.create_session(interval=0.05)
        other = session.create_inference_checkpoint().id
        session.stop()
    return inference, training, other


def test_full_weight_resource_from_an_inference_checkpoint(
    server: LiveServer, models: dict[str, Path]
) -> None:
    inference, training, other = _checkpoints(server)
    merged = load_causal_lm(server.storage / "checkpoints" / inference / "merged")
    expected = [reference_logprobs(merged, s) for s in SEQUENCES]
    base = load_causal_lm(models["tiny-qwen"])
    assert (
        max(
            abs(a - b)
            for e, s in zip(expected, SEQUENCES)
            for a, b in zip(e, reference_logprobs(base, s))
        )
        > 1e-2
    )

    with _resource(server, "tiny-qwen", lora_enabled=False, base_weights_ref=inference) as res:
        assert res.retrieve().base_weights_ref == inference
        session = res.create_session(interval=0.05)
        for got, want in zip(_logprobs(session), expected, strict=True):
            assert got == pytest.approx(want, abs=1e-5)
        session.stop()

    http = httpx.Client(
        base_url=server.api, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60
    )
    bad = {
        "ckpt-" + "0" * 32: "no checkpoint",
        training: "training checkpoint",
        other: "does not match base_model 'tiny-qwen'",
    }
    for ref, words in bad.items():
        body = {"base_model": "tiny-qwen", "lora_enabled": False, FIELD: ref}
        response = http.post("/rl/model-resources", json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == FIELD and words in error["message"], error
    lora = {"base_model": "tiny-qwen", "lora_enabled": True, FIELD: inference}
    response = http.post("/rl/model-resources", json=lora)
    assert response.status_code == 400 and response.json()["error"]["param"] == FIELD
    # nothing was created by the refusals
    listed = http.get("/rl/model-resources", params={"limit": 100}).json()["data"]
    assert not [r for r in listed if r.get(FIELD) and r["id"] and r.get("lora_enabled")]
    assert len([r for r in listed if r.get(FIELD)]) == 1
