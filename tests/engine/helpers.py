"""Builders for engine tests: wire samples from plain lists, and a resource on a tiny model."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from trainer.checkpoint.store import CheckpointStore
from trainer.contract.options import EngineOptions
from trainer.contract.specs import (
    EncodedTextChunk,
    ModelEntry,
    ModelInput,
    ModelInputChunk,
    ResourceSpec,
    Sample,
    TensorData,
)
from trainer.engine.resource import ModelResource

DEVICE = os.environ.get("TRAINER_TEST_DEVICE", "cpu")
"""Where `make_resource` computes: cpu, or cuda for `scripts/gpu_proof.sh`'s engine rows."""


def model_input(tokens: list[int]) -> ModelInput:
    return ModelInput(chunks=[ModelInputChunk(encoded_text=EncodedTextChunk(tokens=tokens))])


def sample(tokens: list[int], targets: list[int], **floats: list[float]) -> Sample:
    inputs = {"target_tokens": TensorData(data=targets, dtype="int64")}
    for name, values in floats.items():
        inputs[name] = TensorData(data=values, dtype="float32")
    return Sample(model_input=model_input(tokens), loss_fn_inputs=inputs)


def random_batch(
    seed: int, n: int = 4, vocab: int = 128, lengths: tuple[int, int] = (3, 12), **extra: str
) -> list[Sample]:
    """`n` samples of random length; `extra` names float inputs to fill ("advantages", ...)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(lengths[0], lengths[1] + 1, (), generator=gen))
        seq = torch.randint(2, vocab, (length + 1,), generator=gen).tolist()
        floats: dict[str, list[float]] = {}
        for name, kind in extra.items():
            if kind == "ones":
                floats[name] = [1.0] * length
            elif kind == "mask":
                floats[name] = [float(v) for v in (torch.rand(length, generator=gen) > 0.3)]
            elif kind == "logprobs":
                floats[name] = (-torch.rand(length, generator=gen) * 4 - 0.5).tolist()
            else:
                floats[name] = torch.randn(length, generator=gen).tolist()
        out.append(sample(seq[:-1], seq[1:], **floats))
    return out


def make_resource(
    model_dir: Path,
    storage: Path,
    *,
    lora: bool = True,
    name: str = "tiny",
    generator: bool = True,
    options: EngineOptions | None = None,
    dtype: str = "float32",
) -> ModelResource:
    # fp32 on every device by default: most tests hold it to fp32 references
    entry = ModelEntry(
        name=name,
        location=str(model_dir),
        max_seq_length=256,
        max_lora_rank=64,
        dtype=dtype,  # type: ignore[arg-type]
    )
    spec = ResourceSpec(
        base_model=name,
        lora_enabled=lora,
        compute_config={"num_generator_replicas": 1 if generator else 0},
    )
    return ModelResource(entry, spec, CheckpointStore(storage), device=DEVICE, options=options)


def weights_of(session) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().clone() for n, p in session.policy.trainable.items()}


def grads_of(session) -> dict[str, torch.Tensor | None]:
    return {
        n: (None if p.grad is None else p.grad.detach().cpu().clone())
        for n, p in session.policy.trainable.items()
    }


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if a[key] is None or b[key] is None:
            assert a[key] is None and b[key] is None, key
        else:
            assert torch.equal(a[key], b[key]), key
