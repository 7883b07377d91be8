"""Building engine objects for the arms: a resource on a saved random model, wire samples."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from benchmarks.shapes import RLBatch
from trainer.checkpoint.store import CheckpointStore
from trainer.contract.specs import (
    EncodedTextChunk,
    ModelEntry,
    ModelInput,
    ModelInputChunk,
    ResourceSpec,
    Sample,
    SessionSpec,
    TensorData,
)


def model_input(tokens: list[int]) -> ModelInput:
    return ModelInput(chunks=[ModelInputChunk(encoded_text=EncodedTextChunk(tokens=tokens))])


def _tensor(data: list[Any], dtype: str) -> TensorData:
    return TensorData.model_validate({"data": data, "dtype": dtype})


def grpo_samples(batch: RLBatch, old_logprobs: list[list[float]]) -> list[Sample]:
    """Prompt + completion as one sample; the prompt is masked out (weights 0)."""
    samples = []
    for prompt, completion, adv, old in zip(
        batch.prompts, batch.completions, batch.advantages_B, old_logprobs
    ):
        seq = prompt + completion
        n = len(seq) - 1  # model_input = seq[:-1], targets = seq[1:]
        p = len(prompt) - 1  # targets from index p on are completion tokens
        mask = [0.0] * p + [1.0] * (n - p)
        logprobs = [0.0] * p + list(old)
        inputs = {
            "target_tokens": _tensor(seq[1:], "int64"),
            "weights": _tensor(mask, "float32"),
            "logprobs": _tensor(logprobs, "float32"),
            "advantages": _tensor([adv] * n, "float32"),
        }
        samples.append(Sample(model_input=model_input(seq[:-1]), loss_fn_inputs=inputs))
    return samples


def ce_samples(batch: RLBatch) -> list[Sample]:
    """Cross entropy on the completion tokens (weights 1), the prompt masked out."""
    samples = []
    for prompt, completion in zip(batch.prompts, batch.completions):
        seq = prompt + completion
        n = len(seq) - 1
        p = len(prompt) - 1
        weights = [0.0] * p + [1.0] * (n - p)
        inputs = {
            "target_tokens": _tensor(seq[1:], "int64"),
            "weights": _tensor(weights, "float32"),
        }
        samples.append(Sample(model_input=model_input(seq[:-1]), loss_fn_inputs=inputs))
    return samples


def make_resource(
    model_dir: str,
    *,
    lora: bool,
    generator: bool = False,
    storage: str | None = None,
    max_seq_length: int = 4096,
    options: dict[str, Any] | None = None,
    device: str = "cpu",
    dtype: str = "auto",
) -> Any:
    from trainer.contract.options import EngineOptions
    from trainer.engine.resource import ModelResource

    entry = ModelEntry.model_validate(
        dict(
            name="bench",
            location=model_dir,
            max_seq_length=max_seq_length,
            max_lora_rank=256,
            max_batch_size=1024,
            dtype=dtype,
        )
    )
    spec = ResourceSpec.model_validate(
        {
            "base_model": "bench",
            "lora_enabled": lora,
            "compute_config": {"num_generator_replicas": 1 if generator else 0},
        }
    )
    root = Path(storage) if storage else Path(tempfile.mkdtemp(prefix="bench-store-"))
    engine_options = EngineOptions(**(options or {}))
    return ModelResource(entry, spec, CheckpointStore(root), device=device, options=engine_options)


def make_session(resource: Any, lora_rank: int | None = None, seed: int = 0) -> Any:
    spec: dict[str, Any] = {}
    if lora_rank is not None:
        spec["lora_config"] = {"rank": lora_rank, "seed": seed}
    return resource.create_session("bench", SessionSpec.model_validate(spec))
