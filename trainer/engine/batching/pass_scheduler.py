"""The per-resource scheduler of forward(-backward) calls: each runs as a pass
(`train_pass.run_pass`), shared with other LoRA sessions' calls where it may.

Design notes: `docs/design/batching.md`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from trainer.compute.batch import PreparedSample
from trainer.compute.placement import Plain
from trainer.engine.batching.combine import Combiner, one_per_session
from trainer.engine.batching.eligibility import can_share
from trainer.engine.batching.train_pass import run_pass
from trainer.engine.batching.work import SharingResource, SharingSession, WorkItem


class PassScheduler:
    """One per resource. `run` is what `TrainingSession` calls; counters for metrics."""

    def __init__(self, resource: SharingResource) -> None:
        self.resource = resource
        self._combiner: Combiner[WorkItem] = Combiner()
        self.passes = 0  # passes run by the combiner and by `record` (passes of one included)
        self.shared_passes = 0  # passes of more than one session
        self.shared_items = 0  # calls that ran in those
        self.max_sessions_per_pass = 0
        self.recent: deque[tuple[str, ...]] = deque(maxlen=64)  # session ids of recent passes

    def eligible(self, session: SharingSession, prepared: Sequence[PreparedSample]) -> bool:
        """Whether this process may run the call in a pass shared with other sessions' calls."""
        resource = self.resource
        if resource.comm.world_size != 1 or not isinstance(resource.placement, Plain):
            return False
        return can_share(session, "pass", prepared)

    def run(self, item: WorkItem) -> None:
        """Run `item`: it ends with its result or its error."""
        if not self.eligible(item.session, item.prepared):
            run_pass([item])
            return
        options = item.session.options
        budget = options.merge_max_tokens
        self._combiner.submit(
            item,
            options.merge_window_ms / 1000.0,
            lambda pending: one_per_session(pending, budget, lambda i: i.tokens),
            self._execute,
            hold=lambda: self.resource.lock,
        )

    def _execute(self, taken: list[WorkItem]) -> None:
        """The forward-backward items as one pass, the forward-only ones as another (first
        arrival first); every item ends done, with its result or its error."""
        try:
            for mode in dict.fromkeys(item.forward_only for item in taken):
                group = [item for item in taken if item.forward_only == mode]
                self.record(group)
                run_pass(group)
        except BaseException as exc:
            for item in taken:
                item.fail(exc)

    def record(self, group: list[WorkItem]) -> None:
        """Count a pass of these items (the combiner's, or one of rank 0's grouped commands)."""
        sessions = len(group)
        self.passes += 1
        if sessions > 1:
            self.shared_passes += 1
            self.shared_items += sessions
        self.max_sessions_per_pass = max(self.max_sessions_per_pass, sessions)
        self.recent.append(tuple(item.session.id for item in group))

    def counters(self) -> dict[str, int]:
        """Metric names are the worker's (`merged_*`: passes shared by several sessions)."""
        return {
            "passes": self.passes,
            "merged_passes": self.shared_passes,
            "merged_items": self.shared_items,
            "max_sessions_per_pass": self.max_sessions_per_pass,
        }
