"""The per-resource scheduler that merges the forward(-backward) calls of LoRA sessions.

Flat combining. Each session's operations already run one at a time on that session's own
queue thread (`trainer/serving/queues.py`), so a session has at most one call here at a time and its
FIFO order holds by construction. A session thread that reaches a mergeable call (forward,
forward-backward, custom forward-backward) has validated and prepared its samples in its own
thread; it hands a `WorkItem` to its resource's scheduler and blocks until the item's result
or error is back. The first waiting thread becomes the combiner: it waits `merge_window_ms`
for other sessions' calls, takes the resource lock, takes the pending items (FIFO, up to
`merge_max_tokens`, one per session) and runs them: the forward-only ones as one pass and the
forward-backward ones as another (`trainer/engine/batching/train_pass.py`). A pass of one item runs
today's
solo path (`TrainingSession._run_alone`). Operations that change a session's weights
(optim-step, weights-sync, sample, checkpoints) never come here: they run on their session's
thread under the lock, so they are barriers for that session only.

A call runs alone (not through the combiner) when merging is off (`[engine] merge`), under
torchrun or any placement other than `Plain` (there rank 0's `trainer/distributed/batching.py`
merges calls before they become commands, and every rank runs the same `run_merged`), when the
model's config has a dropout > 0, when its
session's LoRA has dropout > 0 and the pass would not draw that session's masks exactly as its
solo call does (a device other than the CPU, or a padded attention: see `batching/train_pass.py`),
when its LoRA adapts parameters rather than modules (an MoE model's fused experts, which
`trainer.compute.multilora.segmented` does not handle),
when it needs more than one micro-batch or more than `merge_max_tokens`, when it keeps no
token, or when its session is the resource's only live one.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

from trainer.compute.attention import is_varlen
from trainer.compute.batch import LossNorm, PreparedSample, loss_norm
from trainer.compute.placement import Plain
from trainer.engine.batching.combine import Combiner, one_per_session
from trainer.engine.batching.train_pass import LossFn, WorkItem, run_merged

if TYPE_CHECKING:
    from trainer.engine.session import TrainingSession


def _model_has_dropout(config: Any) -> bool:
    """Any `*dropout*` / `*_pdrop` float of the model's config above 0 (attention dropout...)."""
    values = config.to_dict() if hasattr(config, "to_dict") else {}
    for key, value in values.items():
        named = "dropout" in key or key.endswith("_pdrop")
        if named and isinstance(value, float | int) and not isinstance(value, bool) and value > 0:
            return True
    return False


class MergeScheduler:
    """One per resource. `run` is what `TrainingSession._run` calls; counters for metrics."""

    def __init__(self, resource: Any) -> None:
        self.resource = resource
        self._combiner: Combiner[WorkItem] = Combiner()
        self._model_dropout: bool | None = None
        self.passes = 0  # passes run by the combiner (solo ones included)
        self.merged_passes = 0  # passes of more than one session
        self.merged_items = 0  # calls that ran in those
        self.max_sessions_per_pass = 0
        self.recent: deque[tuple[str, ...]] = deque(maxlen=64)  # session ids of recent passes

    # -- eligibility ---------------------------------------------------------------------------

    def mergeable(self, session: TrainingSession, prepared: list[PreparedSample]) -> bool:
        resource = self.resource
        options = session.options
        if not options.merge or not getattr(resource, "lora", False):
            return False
        if any(s.routes is not None for s in prepared):
            return False  # MoE routing replay (rule 12) runs in the solo pass only
        if resource.comm.world_size != 1 or not isinstance(resource.placement, Plain):
            return False
        config = getattr(session.policy, "config", None)
        if config is None:
            return False
        if not getattr(session.policy, "segmentable", True):
            return False  # LoRA on MoE experts: `segmented` handles module layers only
        if float(config.dropout) > 0 and not self._dropout_exact(session):
            return False
        if self._model_dropout is None:
            self._model_dropout = _model_has_dropout(session.policy.model.config)
        if self._model_dropout:
            return False
        tokens = sum(s.length for s in prepared)
        if tokens > min(options.token_budget, options.merge_max_tokens):
            return False
        sessions = list(getattr(resource, "sessions", {}).values())
        if sum(1 for other in sessions if other.active) < 2:
            return False  # nobody to merge with: no window to wait out
        return any(bool(s.kept_T.any()) for s in prepared)

    def _dropout_exact(self, session: TrainingSession) -> bool:
        """Whether a merged pass draws a dropout session's masks exactly as its solo call
        would: on CPU, with one packed row per call (a varlen attention)."""
        attn = session.policy.model.config._attn_implementation
        return bool(self.resource.device.type == "cpu" and is_varlen(attn))

    # -- the combiner ----------------------------------------------------------------------------

    def run(
        self,
        session: TrainingSession,
        prepared: list[PreparedSample],
        fn: LossFn,
        forward_only: bool,
        return_outputs: bool,
    ) -> dict[str, Any]:
        if not self.mergeable(session, prepared):
            return session._run_alone(prepared, fn, forward_only, return_outputs)
        norm: LossNorm = loss_norm(prepared)
        item = WorkItem(session, prepared, fn, norm, forward_only, return_outputs)
        budget = session.options.merge_max_tokens
        self._combiner.submit(
            item,
            session.options.merge_window_ms / 1000.0,
            lambda pending: one_per_session(pending, budget, lambda i: i.tokens),
            self._execute,
            hold=lambda: self.resource.lock,
        )
        if item.error is not None:
            raise item.error
        assert item.result is not None
        return item.result

    def _execute(self, taken: list[WorkItem]) -> None:
        """The forward-backward items as one pass, the forward-only ones as another (first
        arrival first); every item ends done, with its result or its error."""
        try:
            groups: list[list[WorkItem]] = []
            for mode in dict.fromkeys(item.forward_only for item in taken):
                groups.append([item for item in taken if item.forward_only == mode])
            for group in groups:
                self._count(len(group))
                self.recent.append(tuple(item.session.id for item in group))
                if len(group) == 1:
                    self._alone(group[0])
                else:
                    run_merged(group)
        except BaseException as exc:
            for item in taken:
                item.fail(exc)

    @staticmethod
    def _alone(item: WorkItem) -> None:
        try:
            item.result = item.session._run_alone(
                item.prepared, item.fn, item.forward_only, item.return_outputs
            )
        except BaseException as exc:
            item.fail(exc)

    def _count(self, sessions: int) -> None:
        self.passes += 1
        if sessions > 1:
            self.merged_passes += 1
            self.merged_items += sessions
        self.max_sessions_per_pass = max(self.max_sessions_per_pass, sessions)

    def counters(self) -> dict[str, int]:
        return {
            "passes": self.passes,
            "merged_passes": self.merged_passes,
            "merged_items": self.merged_items,
            "max_sessions_per_pass": self.max_sessions_per_pass,
        }
