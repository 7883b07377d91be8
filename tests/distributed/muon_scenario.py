"""Muon's calls for the 2-rank test, shared by the 1-process reference and the gloo run
(`spmd_case muon`): the same function drives a `ModelResource` and a `DistributedResource`."""

from __future__ import annotations

from typing import Any

from tests.distributed.scenario import session_spec
from tests.engine.helpers import random_batch
from trainer.contract.muon_params import MuonParams
from trainer.contract.specs import AdamParams, LossConfig, ResourceSpec

# clipping active (the norm is well above 0.5), non-default knobs on both sides
MUON = MuonParams(
    learning_rate=1e-2,
    momentum=0.9,
    newton_schulz_steps=4,
    weight_decay=0.01,
    grad_clip_norm=0.5,
    adam=AdamParams(learning_rate=1e-3, eps=1e-4),
)


def muon_resource_spec(kind: str, strategy: str) -> ResourceSpec:
    return ResourceSpec(
        base_model="tiny",
        lora_enabled=kind == "lora",
        optimizer_config={"muon": {"scaling_strategy": strategy}},
        compute_config={"num_generator_replicas": 0},
    )


def drive_muon(resource: Any, kind: str) -> dict[str, Any]:
    """Three GRPO + CE steps with Muon, then a training checkpoint."""
    session = resource.create_session(f"{kind}-m", session_spec(kind))
    steps = []
    for step in range(3):
        grpo = session.forward_backward(
            LossConfig(type="LOSS_TYPE_GRPO"),
            random_batch(600 + step, n=5, advantages="randn", logprobs="logprobs"),
        )
        ce = session.forward_backward(
            LossConfig(type="LOSS_TYPE_CROSS_ENTROPY"),
            random_batch(700 + step, n=3, weights="ones"),
        )
        optim = session.optim_step(muon=MUON)
        steps.append([grpo["loss"], ce["loss"], optim["metrics"]["grad_norm"]])
    out = {"steps": steps, "training": session.save_training_checkpoint().id}
    resource.close_session(f"{kind}-m")
    return out
