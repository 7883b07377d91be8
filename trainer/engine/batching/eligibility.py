"""Whether a call may share a forward(-backward) pass, or a generation batch, with other
sessions' calls: the one predicate that the pass scheduler (`pass_scheduler`), the sample
batcher (`sample_batch`) and rank 0's combiner under torchrun (`trainer/distributed/batching.py`)
ask. Where calls are combined is the caller's: in one process the resource's pass scheduler,
under torchrun rank 0's combiner (every rank then runs the same passes).

Design notes: `docs/design/batching.md`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from trainer.compute.architecture import PACKED, layout_of
from trainer.compute.attention import is_varlen
from trainer.compute.batch import PreparedSample
from trainer.compute.placement import Plain

if TYPE_CHECKING:
    from trainer.engine.batching.work import SharingSession

Kind = Literal["pass", "sample"]


def can_share(
    session: SharingSession, kind: Kind, prepared: Sequence[PreparedSample] | None = None
) -> bool:
    """Whether this call of `session` may share a pass (`kind` "pass"; `prepared`: its samples,
    None before they are prepared) or a generation batch ("sample") with other sessions'
    calls (the module docstring)."""
    options = session.options
    if not (options.merge if kind == "pass" else options.batch_samples):
        return False
    if not session.policy.segmentable:
        return False
    if kind == "pass" and not _pass_allows(session, prepared):
        return False
    if kind == "sample" and not _batch_allows(session):
        return False
    sessions = list(session.resource.sessions.values())  # one C call: a snapshot
    return sum(1 for other in sessions if other.active) >= 2


def _pass_allows(session: SharingSession, prepared: Sequence[PreparedSample] | None) -> bool:
    config = session.policy.config
    if session.resource.model_dropout:
        return False
    if config is not None and float(config.dropout) > 0 and not _masks_exact(session):
        return False
    if prepared is None:
        return True
    if any(s.routed_experts is not None for s in prepared):
        return False
    options = session.options
    if sum(s.length for s in prepared) > min(options.token_budget, options.merge_max_tokens):
        return False
    return any(bool(s.kept_T.any()) for s in prepared)


def _masks_exact(session: SharingSession) -> bool:
    """Whether a shared pass draws a dropout session's masks exactly as its solo call would:
    in one process, on the CPU, with one packed row per call (a varlen attention)."""
    model = session.policy.model
    attn = model.config._attn_implementation
    on_cpu = session.resource.device.type == "cpu"
    packed = layout_of(model) == PACKED
    return bool(session.comm.world_size == 1 and on_cpu and packed and is_varlen(attn))


def _batch_allows(session: SharingSession) -> bool:
    resource = session.resource
    if session.comm.world_size != 1 or not isinstance(resource.placement, Plain):
        return False
    return not resource.lock.held_here()


def model_has_dropout(config: Any) -> bool:
    """Any `*dropout*` / `*_pdrop` number of a model's config (a transformers
    `PretrainedConfig`) above 0: attention dropout, hidden dropout, ..."""
    values = config.to_dict() if hasattr(config, "to_dict") else {}
    for key, value in values.items():
        named = "dropout" in key or key.endswith("_pdrop")
        if named and isinstance(value, float | int) and not isinstance(value, bool) and value > 0:
            return True
    return False
