"""Which generator serves a session's samples: the resource's vLLM replicas when it runs
them (`[generator] backend = "vllm"`), else the in-process decode loop."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer.engine.in_process import InProcessGenerator
from trainer.engine.vllm_generator import VllmGenerator

if TYPE_CHECKING:
    from trainer.compute.policy import Policy
    from trainer.engine.generator import Generator
    from trainer.engine.handle import ResourceHandle


def generator_for(resource: ResourceHandle, policy: Policy, session_id: str) -> Generator:
    """The generator of session `session_id` of `resource`, training `policy`."""
    if resource.replicas is not None:
        return VllmGenerator(resource, policy, resource.replicas, session_id)
    return InProcessGenerator(resource, policy)
