"""`base_weights_ref` under `torchrun --nproc-per-node 2 -m trainer serve`: every rank loads the
inference checkpoint's merged model that rank 0 verified (FSDP2 shards of it), and a fresh
session after a trained one starts from it again. The reference is a plain transformers load of
the checkpoint's `merged/` export."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.api.api_helpers import ce_sample, load_causal_lm, reference_logprobs
from tests.distributed.test_torchrun_serve import TOKEN, _children, _launch, _stop
from tests.engine.helpers import make_resource, random_batch
from trainer.contract.specs import AdamParams, LossConfig, SessionSpec
from trainer.spawn import free_port, wait_healthy

pytestmark = pytest.mark.distributed

SEQUENCES = [[3, 17, 42, 9, 88, 5, 61, 20], [7, 7, 100, 2, 45, 12]]
CE = {"type": "LOSS_TYPE_CROSS_ENTROPY"}


def _inference_checkpoint(model_dir: Path, storage: Path) -> Path:
    """A full-weight session trained two steps, exported (in this process, before the worker
    starts on the same storage)."""
    resource = make_resource(model_dir, storage, lora=False)
    session = resource.create_session("src", SessionSpec())
    for step in range(2):
        session.forward_backward(
            LossConfig(type="cross_entropy"), random_batch(step, n=3, weights="ones")
        )
        session.optim_step(AdamParams(learning_rate=5e-2))
    path = session.save_inference_checkpoint().path
    resource.close()
    resource.store.close()
    return path


def _logprobs(session) -> list[list[float]]:
    out = session.trainer.forward(samples=[ce_sample(s) for s in SEQUENCES], loss=CE)
    return [list(o.tensors["logprobs"].data) for o in out.loss_fn_outputs]


def test_two_ranks_train_from_the_checkpoint(tiny_qwen_dir: Path, tmp_path: Path) -> None:
    from together.post_training import ModelResourcesClient

    storage = tmp_path / "storage"
    checkpoint = _inference_checkpoint(tiny_qwen_dir, storage)
    merged = load_causal_lm(checkpoint / "merged")
    expected = [reference_logprobs(merged, s) for s in SEQUENCES]

    port = free_port()
    proc = _launch(2, tiny_qwen_dir, storage, port)
    pids = [proc.pid]
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc.poll, timeout=180, interval=0.5)
        pids += _children(proc.pid)
        resource = ModelResourcesClient.create(
            api_key=TOKEN,
            base_url=f"http://127.0.0.1:{port}/v1",
            base_model="tiny",
            lora_enabled=False,
            base_weights_ref=checkpoint.name,
            interval=0.1,
        )
        try:
            first = resource.create_session(interval=0.1)
            for got, want in zip(_logprobs(first), expected, strict=True):
                torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=0)
            first.trainer.forward_backward(samples=[ce_sample(s) for s in SEQUENCES], loss=CE)
            first.trainer.optim_step(adam_params={"learning_rate": 5e-2})
            assert _logprobs(first)[0] != pytest.approx(expected[0], abs=1e-4)
            first.stop()
            second = resource.create_session(interval=0.1)
            for got, want in zip(_logprobs(second), expected, strict=True):
                torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=0)
        finally:
            resource.stop(force=True)
    finally:
        _stop(proc, pids)
