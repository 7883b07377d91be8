"""The calls a distributed test makes, shared by the 1-process reference and the 2-rank run.

`drive` only uses the interface `ModelResource` and `DistributedResource` have in common, so
the same function produces both sides of each comparison.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.engine.helpers import model_input, random_batch
from trainer.checkpoint.export import AdapterExport
from trainer.contract.options import EngineOptions
from trainer.contract.specs import (
    AdamParams,
    Gradient,
    LoraConfig,
    LossConfig,
    ModelEntry,
    ResourceSpec,
    Sample,
    SamplingParams,
    SessionSpec,
    TensorData,
)

# Small rows and budgets: several micro-batches per call, unevenly split over two ranks.
OPTIONS = EngineOptions(row_tokens=16, token_budget=16, chunk_tokens=8)
# Adam's eps at 1e-4, not 1e-8: with 1e-8, an entry whose gradient is ~1e-7 moves by ~±lr
# and the order of a float sum decides its sign, so weights could not be compared at 1e-4.
# Losses and gradient norms are compared at every step whatever eps is.
ADAM = AdamParams(learning_rate=1e-3, eps=1e-4)
PROMPT = [5, 6, 7, 8]
# a recipient whose identity nobody keeps: the 2-rank run only shows the export crosses ranks
RECIPIENT = "age1ql3z7hjy54pw3hyww5ayyfg7zqgvc7w3j2elw8zmrj2kg5sfn9aqmcac8p"


def entry(model_dir: str) -> ModelEntry:
    return ModelEntry(name="tiny", location=model_dir, max_seq_length=256, max_lora_rank=64)


def resource_spec(kind: str) -> ResourceSpec:
    return ResourceSpec(
        base_model="tiny",
        lora_enabled=kind == "lora",
        compute_config={"num_generator_replicas": 1},
    )


def session_spec(kind: str, resume_id: str | None = None) -> SessionSpec:
    if kind == "lora":
        lora = LoraConfig(rank=8, alpha=16, seed=3)
        return SessionSpec(lora_config=lora, resume_from_checkpoint_id=resume_id)
    return SessionSpec(resume_from_checkpoint_id=resume_id)


def drive(resource: Any, kind: str) -> dict[str, Any]:
    """Sample at step 0, train 4 steps (PPO on 3 samples, GRPO on 5; then soft-target cross
    entropy on 5 and custom on 3), forward, sync, then write a training and an inference
    checkpoint."""
    session = resource.create_session(f"{kind}-a", session_spec(kind))
    params = SamplingParams(max_tokens=5, seed=11, temperature=1.0)
    prompts = [model_input(PROMPT)]
    out: dict[str, Any] = {
        "sample0": session.sample(prompts, num_samples=2, sampling_params=params)
    }
    steps = []
    for step in range(3):
        ppo = session.forward_backward(
            LossConfig(type="LOSS_TYPE_PPO"),
            random_batch(100 + step, n=3, advantages="randn", logprobs="logprobs"),
        )
        grpo = session.forward_backward(
            LossConfig(type="LOSS_TYPE_GRPO"),
            random_batch(200 + step, n=5, advantages="randn", logprobs="logprobs"),
        )
        optim = session.optim_step(ADAM)
        steps.append([ppo["loss"], grpo["loss"], optim["metrics"]["grad_norm"]])
        out["ppo_metrics"] = ppo["metrics"]
    # cross entropy on [T, 3] soft targets (docs/semantics.md §1), accumulated with a custom
    # forward-backward into the last step
    out["soft"] = session.forward_backward(
        LossConfig(type="LOSS_TYPE_CROSS_ENTROPY"), soft_batch(500), return_loss_fn_outputs=True
    )
    batch = random_batch(300, n=3)
    grads = [Gradient(data=[0.5] * len(s.model_input.tokens)) for s in batch]
    session.custom_forward_backward(batch, grads)
    optim = session.optim_step(ADAM)
    steps.append([0.0, 0.0, optim["metrics"]["grad_norm"]])
    out["steps"] = steps
    out["forward"] = session.forward_backward(
        LossConfig(type="LOSS_TYPE_CROSS_ENTROPY"),
        random_batch(400, n=3, weights="ones"),
        forward_only=True,
        return_loss_fn_outputs=True,
    )
    session.weights_sync("WEIGHT_SYNC_TYPE_SYNCHRONOUS")
    out["sample1"] = session.sample(prompts, num_samples=2, sampling_params=params)
    out["step"] = session.step
    out["training"] = session.save_training_checkpoint().id
    out["inference"] = str(session.save_inference_checkpoint().path)
    out.update(exports(session, kind))
    resource.close_session(f"{kind}-a")
    return out


def exports(session: Any, kind: str) -> dict[str, str]:
    """A LoRA session's adapter exports (Tinker's naming), plain and age-encrypted."""
    if kind != "lora":
        return {}
    plain, sealed = AdapterExport("tinker"), AdapterExport("tinker", (RECIPIENT,))
    return {
        "export": str(session.save_inference_checkpoint(export=plain).path),
        "sealed": str(session.save_inference_checkpoint(export=sealed).path),
    }


def soft_batch(seed: int, k: int = 3) -> list[Sample]:
    """Samples whose `target_tokens` and `weights` are [T, K] (the first position's weights 0)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for s in random_batch(seed, n=5):
        t = len(s.model_input.tokens)
        targets = torch.randint(0, 128, (t, k), generator=gen)
        weights = torch.rand(t, k, generator=gen)
        weights[0] = 0.0
        inputs = {
            "target_tokens": TensorData(
                data=targets.reshape(-1).tolist(), dtype="int64", shape=[t, k]
            ),
            "weights": TensorData(data=weights.reshape(-1).tolist(), dtype="float32", shape=[t, k]),
        }
        out.append(Sample(model_input=s.model_input, loss_fn_inputs=inputs))
    return out


def resume_and_save(resource: Any, kind: str, checkpoint_id: str) -> dict[str, str]:
    """Resume a training checkpoint and save it again at once (training and inference): both
    must match the checkpoints saved by the run that wrote `checkpoint_id`, bit for bit."""
    session = resource.create_session(f"{kind}-r", session_spec(kind, checkpoint_id))
    saved = {
        "training": session.save_training_checkpoint().id,
        "inference": str(session.save_inference_checkpoint().path),
        **exports(session, kind),
    }
    resource.close_session(f"{kind}-r")
    return saved


def train_packed(resource: Any, kind: str) -> dict[str, Any]:
    """One PPO forward-backward on 6 mixed-length samples packed several to a row, then a
    forward: the calls whose attention `attention_spy` watches."""
    session = resource.create_session(f"{kind}-p", session_spec(kind))
    batch = random_batch(500, n=6, lengths=(2, 6), advantages="randn", logprobs="logprobs")
    out = {
        "train": session.forward_backward(LossConfig(type="LOSS_TYPE_PPO"), batch)["loss"],
        "forward": session.forward_backward(
            LossConfig(type="LOSS_TYPE_CROSS_ENTROPY"),
            random_batch(501, n=5, lengths=(2, 6), weights="ones"),
            forward_only=True,
        )["loss"],
    }
    resource.close_session(f"{kind}-p")
    return out


FAMILY_PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22]]


def family_forward(resource: Any) -> dict[str, Any]:
    """A LoRA session's forward of four 8–24-token samples in one call, its layout, and its
    samples of two prompts of different lengths (`test_families_sharded`)."""
    from trainer.compute.architecture import layout_of

    session = resource.create_session("fam", session_spec("lora"))
    samples = random_batch(900, n=4, lengths=(8, 24), weights="ones")
    out = session.forward_backward(
        LossConfig(type="LOSS_TYPE_CROSS_ENTROPY"),
        samples,
        forward_only=True,
        return_loss_fn_outputs=True,
    )
    params = SamplingParams(max_tokens=6, seed=5, temperature=1.0)
    prompts = [model_input(p) for p in FAMILY_PROMPTS]
    sampled = session.sample(prompts, num_samples=1, sampling_params=params)
    local = getattr(resource, "local", resource)  # rank 0's own resource under torchrun
    layout = layout_of(local.model)
    resource.close_session("fam")
    return {
        "tokens": [s.model_input.tokens for s in samples],
        "targets": [s.loss_fn_inputs["target_tokens"].data for s in samples],
        "logprobs": [o["tensors"]["logprobs"]["data"] for o in out["loss_fn_outputs"]],
        "sampled": [r["sequences"][0] for r in sampled["results"]],
        "layout": layout,
    }


def grammar_samples(resource: Any, kind: str, grammars: dict[str, Any]) -> dict[str, Any]:
    """A session's constrained samples (docs/semantics.md §17.2): two prompts, two samples
    each, at temperature 1 under each of `grammars` (`test_grammar_sharded`)."""
    session = resource.create_session(f"{kind}-grammar", session_spec(kind))
    params = SamplingParams(max_tokens=24, seed=13, temperature=1.0)
    prompts = [model_input(PROMPT), model_input([9, 10])]
    out = {}
    for name, grammar in grammars.items():
        sampled = session.sample(prompts, num_samples=2, sampling_params=params, grammar=grammar)
        out[name] = [seq for result in sampled["results"] for seq in result["sequences"]]
    resource.close_session(f"{kind}-grammar")
    return out
