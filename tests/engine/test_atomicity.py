"""A FAILED operation changes nothing: twins built identically with the same seeds, one of
which makes failing calls, stay bit-identical (weights, gradients, AdamW state, step, versions,
pending publish, generator weights, RNG) and keep sampling the same tokens afterwards.

The failures are real ones the engine hits: a non-finite loss (importance ratio overflow) after
earlier micro-batches ran their dropout forward and backward; a custom gradient whose loss
overflows; a NaN gradient at optim-step; a storage directory that cannot be written; and a
generator that dies mid-generation (the model's forward raises CUDA's out-of-memory error after
the prefill and a decoding step, as a real OOM would), after the sample has drawn its seed from
the session's RNG and applied a pending BACKGROUND_PUBLISH / PIPELINE snapshot.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.engine.helpers import make_resource, model_input, random_batch, sample
from trainer.compute import optim
from trainer.contract.errors import OperationError
from trainer.contract.options import EngineOptions
from trainer.contract.specs import (
    AdamParams,
    Gradient,
    LoraConfig,
    LossConfig,
    SamplingParams,
    SessionSpec,
)

CE = LossConfig(type="cross_entropy")
SMALL = EngineOptions(row_tokens=16, token_budget=16)  # several micro-batches per call
PROMPTS = [model_input([5, 6, 7]), model_input([9, 10, 11, 12])]
UNSEEDED = SamplingParams(max_tokens=5, temperature=1.0)  # draws its seed from the session RNG


@pytest.fixture(scope="module")
def dropout_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny tied Qwen3 with attention dropout, so full-weight training consumes RNG too."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.conftest import build_tiny_model

    out = build_tiny_model("qwen3", tmp_path_factory.mktemp("tiny-dropout"))
    config = AutoConfig.from_pretrained(out)
    config.attention_dropout = 0.2
    AutoModelForCausalLM.from_pretrained(out, config=config).save_pretrained(out)
    return out


def _twins(kind: str, model_dir: Path, tmp_path: Path):
    if kind == "lora":
        resource = make_resource(model_dir, tmp_path / "store", options=SMALL)
        spec = SessionSpec(lora_config=LoraConfig(rank=4, dropout=0.3, seed=11))
        return resource.create_session("a", spec), resource.create_session("b", spec)
    a = make_resource(model_dir, tmp_path / "a", lora=False, options=SMALL)
    b = make_resource(model_dir, tmp_path / "b", lora=False, options=SMALL)
    twin_a, twin_b = a.create_session("a", SessionSpec()), b.create_session("b", SessionSpec())
    twin_b.restore_rng({"cpu": twin_a.cpu_rng})  # full sessions draw their seed
    return twin_a, twin_b


def _state(session) -> dict[str, object]:
    def copy(tensors):
        return {n: (None if t is None else t.detach().clone()) for n, t in tensors.items()}

    pending = session.versions.pending
    return {
        "weights": copy(session.policy.trainable),
        "grads": copy({n: p.grad for n, p in session.policy.trainable.items()}),
        "optimizer": copy(optim.state_tensors(session.optimizer, session.policy.trainable)),
        "published": copy(session.policy.published_tensors()),
        "pending": None if pending is None else (copy(pending[0]), pending[1]),
        "step": session.step,
        "policy_state": session.policy_state(),
        "rng": [session.cpu_rng.clone(), *(s.clone() for s in session.cuda_rng)],
    }


def _assert_identical(a, b, path="state") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, path
        bits_a, bits_b = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
        assert torch.equal(bits_a, bits_b), path  # bit for bit
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for key in a:
            _assert_identical(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_identical(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _generator_model(session) -> torch.nn.Module:
    with session.resource.lock, session.policy.published() as model:
        return model


class _DeviceOOM:
    """A forward hook that fails the model's `after`-th call onwards with CUDA's OOM error."""

    def __init__(self, model: torch.nn.Module, after: int) -> None:
        self.calls, self.after = 0, after
        self.handle = model.register_forward_pre_hook(self)

    def __call__(self, module, args) -> None:
        self.calls += 1
        if self.calls >= self.after:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def _failing_sample(session) -> None:
    oom = _DeviceOOM(_generator_model(session), after=3)  # prefill, one step, then OOM
    try:
        with pytest.raises(torch.OutOfMemoryError):
            session.sample(PROMPTS, num_samples=3, sampling_params=UNSEEDED)
    finally:
        oom.handle.remove()
    assert oom.calls == 3


def _failing_forward_backward(session) -> None:
    overflow = sample([3, 4], [4, 5], logprobs=[-1e4] * 2, advantages=[1.0] * 2)
    # full rows of 16 tokens, one micro-batch each: the overflow comes last, after the others'
    # dropout forward and backward
    batch = random_batch(40, n=4, lengths=(16, 16), logprobs="logprobs", advantages="x")
    with pytest.raises(OperationError) as info:
        session.forward_backward(LossConfig(type="importance_sampling"), [*batch, overflow])
    assert info.value.code == "NON_FINITE_LOSS"


def _failing_custom(session) -> None:
    samples = random_batch(41, n=4, lengths=(6, 12))
    grads = [Gradient(data=[3e38] * len(s.model_input.tokens)) for s in samples]
    with pytest.raises(OperationError) as info:
        session.custom_forward_backward(samples, grads)
    assert info.value.code == "NON_FINITE_LOSS"


def _failing_optim_step(session) -> None:
    param = next(p for p in session.policy.trainable.values() if p.grad is not None)
    held = param.grad.clone()
    param.grad.view(-1)[0] = float("nan")
    with pytest.raises(OperationError) as info:
        session.optim_step(AdamParams(learning_rate=1e-2))
    assert info.value.code == "NON_FINITE_LOSS"
    param.grad.copy_(held)  # the NaN was the test's, not the operation's


def _failing_checkpoints(session) -> None:
    tmp = session.resource.store.tmp
    shutil.rmtree(tmp)
    tmp.write_text("not a directory")  # every new checkpoint directory fails to be created
    try:
        with pytest.raises((OSError, OperationError)):
            session.save_training_checkpoint()
        with pytest.raises((OSError, OperationError)):
            session.save_inference_checkpoint()
    finally:
        tmp.unlink()
        tmp.mkdir()


def _train(session, seed: int) -> None:
    session.forward_backward(CE, random_batch(seed, n=5, lengths=(4, 14), weights="ones"))
    session.optim_step(AdamParams(learning_rate=2e-2))


@pytest.mark.parametrize(
    ("kind", "sync_type"),
    [
        ("lora", "WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH"),
        ("lora", "WEIGHT_SYNC_TYPE_PIPELINE"),
        ("full", "WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH"),
        ("full", "WEIGHT_SYNC_TYPE_PIPELINE"),
    ],
)
def test_failed_operations_leave_twins_identical(
    kind, sync_type, dropout_model_dir, tiny_qwen_dir, tmp_path
) -> None:
    a, b = _twins(kind, tiny_qwen_dir if kind == "lora" else dropout_model_dir, tmp_path)
    for twin in (a, b):
        _train(twin, 1)
        twin.forward_backward(CE, random_batch(2, weights="ones"))  # gradients to keep
        twin.weights_sync(sync_type)
    assert a.policy_state() == {
        "trainer_step": 1,
        "target_weights_version": 1,
        "applied_weights_version": 0,
        "pending_publish": True,
    }
    _assert_identical(_state(a), _state(b))

    failing = [
        _failing_sample,  # snapshot still pending, generator unchanged, seed draw undone
        _failing_forward_backward,
        _failing_custom,
        _failing_optim_step,
        _failing_checkpoints,
        _failing_sample,
    ]
    for fail in failing:
        fail(a)
        _assert_identical(_state(a), _state(b), fail.__name__)

    # the same real operations on both: sampling without a seed, dropout, steps, syncs
    for step in range(2):
        outs = [t.sample(PROMPTS, num_samples=3, sampling_params=UNSEEDED) for t in (a, b)]
        assert outs[0] == outs[1]
        assert outs[0]["results"][0]["policy_segments"] == [{"start_token": 0, "version": step + 1}]
        for twin in (a, b):
            _train(twin, 10 + step)
            twin.weights_sync(sync_type)
        _assert_identical(_state(a), _state(b))
    assert a.policy_state()["applied_weights_version"] == 2
    assert a.policy_state()["pending_publish"] is True


def test_failed_sample_after_synchronous_sync_keeps_versions(tiny_qwen_dir, tmp_path) -> None:
    """Nothing pending: a failing sample still leaves the RNG where it was (its seed draw is
    undone) and the next unseeded samples match the twin's."""
    a, b = _twins("lora", tiny_qwen_dir, tmp_path)
    for twin in (a, b):
        _train(twin, 3)
        twin.weights_sync("WEIGHT_SYNC_TYPE_SYNCHRONOUS")
    _failing_sample(a)
    _assert_identical(_state(a), _state(b))
    outs = [t.sample(PROMPTS, num_samples=2, sampling_params=UNSEEDED) for t in (a, b)]
    assert outs[0] == outs[1]


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_failed_forward_backward_keeps_the_dropout_rng(
    kind, dropout_model_dir, tiny_qwen_dir, tmp_path
) -> None:
    """The issue's case: NON_FINITE_LOSS after dropout forwards and backwards ran; the twins
    then train with dropout and sample unseeded, and stay bit-identical."""
    a, b = _twins(kind, tiny_qwen_dir if kind == "lora" else dropout_model_dir, tmp_path)
    _failing_forward_backward(a)
    _assert_identical(_state(a), _state(b))
    for twin in (a, b):
        _train(twin, 7)
        twin.weights_sync("WEIGHT_SYNC_TYPE_SYNCHRONOUS")
    _assert_identical(_state(a), _state(b))
    outs = [t.sample(PROMPTS, num_samples=2, sampling_params=UNSEEDED) for t in (a, b)]
    assert outs[0] == outs[1]
