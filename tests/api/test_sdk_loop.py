"""The official SDK (`together==3.1.1`), unchanged, drives a live worker through whole loops."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import pytest
import together
from api_helpers import (
    LOSSES,
    SEQUENCES,
    ce_sample,
    load_causal_lm,
    model_input,
    policy_sample,
    reference_logprobs,
)
from conftest import TOKEN, LiveServer
from together import Together
from together.post_training import ModelResourcesClient, SessionClient, download_checkpoint

CE = {"type": "LOSS_TYPE_CROSS_ENTROPY"}


def _resource(server: LiveServer, base_model: str, lora: bool) -> ModelResourcesClient:
    return ModelResourcesClient.create(
        api_key=TOKEN,
        base_url=server.api,
        base_model=base_model,
        lora_enabled=lora,
        inactive_timeout=600,
        interval=0.05,
    )


def _logprobs(session: SessionClient, sequences: list[list[int]]) -> list[list[float]]:
    out = session.trainer.forward(samples=[ce_sample(s) for s in sequences], loss=CE)
    assert out.loss_fn_outputs is not None
    return [list(o.tensors["logprobs"].data) for o in out.loss_fn_outputs]


def _close(a: list[float], b: list[float], tol: float = 2e-4) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b))


def _sample_and_check(session: SessionClient, version: int) -> None:
    """Sampled logprobs = forward logprobs of the same tokens on the published weights."""
    prompt = [3, 17, 42]
    result = session.generator.sample(
        model_input(prompt),
        num_samples=2,
        sampling_params={"max_tokens": 4, "temperature": 1.0, "seed": 7},
        prompt_logprobs=True,
        topk_prompt_logprobs=3,
    )
    assert [s.version for s in result.policy_segments] == [version]
    assert len(result.sequences) == 2
    seq = result.sequences[0]
    tokens = [int(t) for t in seq.tokens]
    assert 1 <= len(tokens) <= 4 and seq.logprobs is not None
    forward = _logprobs(session, [prompt + tokens])[0]
    assert _close(forward[len(prompt) - 1 :], list(seq.logprobs))
    assert result.prompt_logprobs is not None and len(result.prompt_logprobs) == len(prompt)
    assert result.prompt_logprobs[0] == 0.0
    assert _close(result.prompt_logprobs[1:], forward[: len(prompt) - 1])
    assert result.topk_prompt_logprobs is not None
    assert len(result.topk_prompt_logprobs[1].token_ids or []) == 3


def _download(server: LiveServer, checkpoint_id: str, variant: str, out: Path) -> Path:
    client = Together(api_key=TOKEN, base_url=server.api)
    files = download_checkpoint(client, checkpoint_id, variant=variant, output_dir=out)  # type: ignore[arg-type]
    assert files and all(f.stat().st_size > 0 for f in files)
    return out


def test_lora_loop(server: LiveServer, models: dict[str, Path], tmp_path: Path) -> None:
    from peft import PeftModel

    with _resource(server, "tiny-qwen", lora=True) as resource:
        session = resource.create_session(
            lora_config={"rank": 4, "alpha": 8, "seed": 0}, display_name="loop", interval=0.05
        )
        trainer = session.trainer
        samples = [ce_sample(s) for s in SEQUENCES]
        fwd = trainer.forward(samples=samples, loss=CE)
        logprobs = _logprobs(session, SEQUENCES)
        assert fwd.loss == pytest.approx(-sum(map(sum, logprobs)), rel=1e-5)

        for loss in LOSSES:  # behaviour = current policy, so every ratio is 1
            batch = [
                policy_sample(s, lp, [0.5] * len(lp), reference=lp)
                for s, lp in zip(SEQUENCES, logprobs)
            ]
            out = trainer.forward_backward(samples=batch, loss=loss)
            assert math.isfinite(out.loss), loss["type"]
        out = trainer.forward_backward(samples=samples, loss={"type": "cross_entropy"})
        assert out.loss == pytest.approx(fwd.loss, rel=1e-5)
        trainer.custom_forward_backward(
            samples=samples, gradients=[{"data": [-1.0] * len(lp)} for lp in logprobs]
        )
        assert int(trainer.optim_step(adam_params={"learning_rate": 1e-2}).step) == 1
        assert not _close(_logprobs(session, SEQUENCES)[0], logprobs[0])
        assert int(trainer.weights_sync().weights_version) == 1
        _sample_and_check(session, version=1)

        training = session.create_training_checkpoint()
        inference = session.create_inference_checkpoint()
        view = session.retrieve()
        assert view.status == "TRAINING_SESSION_STATUS_RUNNING" and int(view.step) == 1
        assert [c.id for c in view.training_checkpoints] == [training.id]
        assert [c.id for c in view.inference_checkpoints] == [inference.id]
        assert int(view.policy_state.applied_weights_version) == 1
        assert view.lora_config is not None and view.lora_config.rank == 4
        assert view.display_name == "loop"

        merged = load_causal_lm(
            _download(server, inference.id, "CHECKPOINT_VARIANT_MERGED", tmp_path / "m")
        )
        adapter_dir = _download(server, inference.id, "CHECKPOINT_VARIANT_ADAPTER", tmp_path / "a")
        adapted = PeftModel.from_pretrained(load_causal_lm(models["tiny-qwen"]), adapter_dir).eval()
        served = _logprobs(session, SEQUENCES)
        for sequence, expected in zip(SEQUENCES, served):
            assert _close(reference_logprobs(merged, sequence), expected)
            assert _close(reference_logprobs(adapted, sequence), expected)

        listed = Together(api_key=TOKEN, base_url=server.api).post_training.checkpoints.list(
            session_id=session.session_id, type="CHECKPOINT_TYPE_INFERENCE"
        )
        assert [c.id for c in listed.data] == [inference.id]
        assert listed.data[0].lora_rank == 4 and listed.data[0].base_model == "tiny-qwen"
        stopped = session.stop()
        assert stopped is not None
        assert status_of(server, "training-sessions", session.session_id) == (
            "TRAINING_SESSION_STATUS_STOPPED"
        )
    assert status_of(server, "model-resources", resource.model_resources_id) == (
        "MODEL_RESOURCES_STATUS_STOPPED"
    )


def status_of(server: LiveServer, collection: str, ident: str) -> str:
    with server.client() as http:
        status: str = http.get(f"/rl/{collection}/{ident}").json()["status"]
        return status


def test_full_weight_loop(server: LiveServer, tmp_path: Path) -> None:
    with _resource(server, "tiny-llama", lora=False) as resource:
        session = resource.create_session(interval=0.05)
        with pytest.raises(together.BadRequestError, match="RESOURCE_AT_CAPACITY"):
            resource.create_session(interval=0.05)
        trainer = session.trainer
        before = _logprobs(session, SEQUENCES)
        trainer.forward_backward(samples=[ce_sample(s) for s in SEQUENCES], loss=CE)
        assert int(trainer.optim_step(adam_params={"learning_rate": 1e-3}).step) == 1
        assert not _close(_logprobs(session, SEQUENCES)[0], before[0])
        assert int(trainer.weights_sync().weights_version) == 1
        _sample_and_check(session, version=1)
        inference = session.create_inference_checkpoint()
        assert session.retrieve().lora_config is None
        merged = load_causal_lm(
            _download(server, inference.id, "CHECKPOINT_VARIANT_MERGED", tmp_path)
        )
        for sequence, expected in zip(SEQUENCES, _logprobs(session, SEQUENCES)):
            assert _close(reference_logprobs(merged, sequence), expected)
        client = Together(api_key=TOKEN, base_url=server.api)
        with pytest.raises(together.BadRequestError, match="ADAPTER"):
            client.post_training.checkpoints.download(
                id=inference.id, variant="CHECKPOINT_VARIANT_ADAPTER"
            )
        resource.stop(force=True)  # also stops the session
    assert status_of(server, "training-sessions", session.session_id) == (
        "TRAINING_SESSION_STATUS_STOPPED"
    )


def _train_step(session: SessionClient) -> None:
    session.trainer.forward_backward(samples=[ce_sample(s) for s in SEQUENCES], loss=CE)
    session.trainer.optim_step(adam_params={"learning_rate": 1e-2})


def test_resume_with_and_without_optimizer(server: LiveServer) -> None:
    with _resource(server, "tiny-qwen", lora=True) as resource:
        original = resource.create_session(lora_config={"rank": 4, "seed": 1}, interval=0.05)
        _train_step(original)
        checkpoint = original.create_training_checkpoint()
        at_save = _logprobs(original, SEQUENCES)

        with_opt = resource.create_session(resume_from_checkpoint_id=checkpoint.id, interval=0.05)
        without = resource.create_session(
            resume_from_checkpoint_id=checkpoint.id, load_optimizer=False, interval=0.05
        )
        assert int(with_opt.retrieve().step) == 1 and int(without.retrieve().step) == 0
        assert with_opt.retrieve().resume_from_checkpoint_id == checkpoint.id
        for resumed in (with_opt, without):
            for got, expected in zip(_logprobs(resumed, SEQUENCES), at_save):
                assert _close(got, expected, 1e-6)

        for session in (original, with_opt, without):
            _train_step(session)
        reference = _logprobs(original, SEQUENCES)
        assert all(_close(a, b, 1e-5) for a, b in zip(_logprobs(with_opt, SEQUENCES), reference))
        assert not _close(_logprobs(without, SEQUENCES)[0], reference[0], 1e-5)
        resource.stop(force=True)


def test_payload_offloaded_forward_backward(server: LiveServer) -> None:
    """A >0.5 MiB body goes through upload-url + PUT; the large result comes back by payload."""
    rng = random.Random(0)
    sequences = [[rng.randrange(2, 128) for _ in range(500)] for _ in range(64)]  # 512 positions
    samples = [ce_sample(s, [rng.random() for _ in s[1:]]) for s in sequences]
    with _resource(server, "tiny-qwen", lora=True) as resource:
        session = resource.create_session(interval=0.05)
        whole = session.trainer.forward(samples=samples, loss=CE)
        payload_dir = server.storage / "payloads" / session.session_id
        assert len(list(payload_dir.glob("*.json"))) >= 2  # the request and the result
        halves = [
            session.trainer.forward(samples=part, loss=CE) for part in (samples[:32], samples[32:])
        ]
        assert whole.loss == pytest.approx(sum(h.loss for h in halves), rel=1e-5)
        assert whole.loss_fn_outputs is not None and len(whole.loss_fn_outputs) == 64
        assert len(whole.loss_fn_outputs[3].tensors["logprobs"].data) == 499
        out = session.trainer.forward_backward(samples=samples, loss=CE)
        assert out.loss == pytest.approx(whole.loss, rel=1e-5)
        assert int(session.trainer.optim_step().step) == 1
        resource.stop(force=True)


def test_tinker_shim_loop(server: LiveServer) -> None:
    tinker_api = pytest.importorskip("together.post_training.tinker")
    types: Any = tinker_api.types
    with _resource(server, "tiny-qwen", lora=True) as resource:
        service = tinker_api.ServiceClient(
            base_url=server.api, api_key=TOKEN, model_resources_id=resource.model_resources_id
        )
        client = service.create_lora_training_client(base_model="tiny-qwen", rank=4, seed=0)
        data = [
            types.Datum(
                model_input=types.ModelInput.from_ints(s[:-1]),
                loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * (len(s) - 1)},
            )
            for s in SEQUENCES
        ]
        first = client.forward_backward(data, "cross_entropy").result()
        assert first.metrics["loss:sum"] > 0
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        second = client.forward(data, "cross_entropy").result()
        assert second.metrics["loss:sum"] < first.metrics["loss:sum"]
        sampler = client.save_weights_and_get_sampling_client()
        response = sampler.sample(
            prompt=types.ModelInput.from_ints([3, 17, 42]),
            num_samples=2,
            sampling_params=types.SamplingParams(max_tokens=3, seed=1),
        ).result()
        assert len(response.sequences) == 2
        state = client.save_state("ignored").result()
        assert state.path.startswith("ckpt-")
        client.close()
        resource.stop(force=True)
