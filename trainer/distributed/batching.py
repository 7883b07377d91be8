"""Merged passes under torchrun: rank 0's scheduler and the command every rank runs.

Rank 0. Each session's operations run one at a time on its queue thread and reach its
`DistributedSession`; a mergeable call (forward-backward, forward, custom forward-backward of
a LoRA session, merging on, no dropout, another live session on the resource) goes to the
resource's `DistributedMerger` instead of being sent alone. The merger combines flat, as
`trainer/engine/batching/pass_scheduler.py` does in one process: the first waiting thread waits
`merge_window_ms`, takes
every pending call (one per session by construction) and sends them as ONE command,
`merged_pass`, naming each call's session, operation and JSON arguments. A group of one is sent
as the plain command (the solo path). Sessions not in the group are untouched; operations that
change weights never come here (barriers for their own session only).

Every rank (`run_group`, from `spmd.Executor`). Each call runs its session's own method (so its
validation is the solo one) until the method hands its prepared samples to the resource's
scheduler, where they are captured as a `WorkItem`. Then, in call order, forward-backward
calls and forward-only calls form one pass each (`merge_max_tokens` per pass; a call that does
not fit in one micro-batch, or keeps no token, runs alone) through `merged_pass.run_merged`, the
same engine path as one process: each rank its share of each call's samples, the FSDP root,
one report exchange, global failures and finite checks, replicated gradients summed. Every rank
decides the same groups from the same command, so the collectives stay in step.

Outcome: the command returns one outcome per call, the same on every rank (failures are global),
so the command itself succeeds and rank 0 hands each waiting thread its result or its own
`OperationError`: a call that fails (bad input, non-finite loss) fails alone and leaves its
session unchanged. Any other exception fails the command, and the group, as any command does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trainer.compute.batch import LossNorm, PreparedSample, loss_norm
from trainer.contract.errors import OperationError
from trainer.engine.batching.combine import Combiner
from trainer.engine.batching.pass_scheduler import _model_has_dropout
from trainer.engine.batching.train_pass import LossFn, WorkItem, run_merged

if TYPE_CHECKING:
    from trainer.engine.resource import ModelResource
    from trainer.engine.session import TrainingSession

MERGED_OP = "merged_pass"
MERGEABLE = ("forward_backward", "custom_forward_backward")


class _Captured(Exception):  # control flow only: never escapes `run_group`
    def __init__(self, item: WorkItem) -> None:
        super().__init__("captured")
        self.item = item


class _Capture:
    """Stands in for the resource's scheduler while `run_group` runs a call's method: the
    method's prepared samples come back as a `WorkItem` instead of running. Anything else
    (counters, for the metrics route) is the real scheduler's."""

    def __init__(self, scheduler: Any) -> None:
        self._scheduler = scheduler

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scheduler, name)

    def run(
        self,
        session: TrainingSession,
        prepared: list[PreparedSample],
        fn: LossFn,
        forward_only: bool,
        return_outputs: bool,
    ) -> dict[str, Any]:
        norm: LossNorm = loss_norm(prepared)
        raise _Captured(WorkItem(session, prepared, fn, norm, forward_only, return_outputs))


def _fits(item: WorkItem) -> bool:
    """One micro-batch, within `merge_max_tokens`, at least one kept token (else alone)."""
    options = item.session.options
    if item.tokens > min(options.token_budget, options.merge_max_tokens):
        return False
    return any(bool(s.kept_T.any()) for s in item.prepared)


def _failed(exc: OperationError) -> dict[str, Any]:
    return {"ok": False, "code": exc.code, "message": exc.message, "field": exc.field}


def run_group(
    resource: ModelResource,
    calls: list[dict[str, Any]],
    session_op: Callable[[TrainingSession, str, dict[str, Any]], Any],
) -> list[dict[str, Any]]:
    """Every rank: the calls of one `merged_pass` command; one outcome per call,
    `{"ok": True, "result": ...}` or `{"ok": False, "code", "message", "field"}`. `session_op`
    runs one call's engine method (`spmd._session_op`: passed in, so this module does not
    import the command stream that imports it)."""
    outcomes: list[dict[str, Any] | None] = [None] * len(calls)
    items: list[tuple[int, str, WorkItem]] = []
    scheduler = resource.scheduler
    resource.scheduler = _Capture(scheduler)  # type: ignore[assignment]
    try:
        for i, call in enumerate(calls):
            session = resource.sessions.get(call["session"])
            if session is None:
                message = f"session {call['session']} is not running"
                outcomes[i] = _failed(OperationError("SESSION_NOT_ACTIVE", message))
                continue
            try:
                outcomes[i] = {"ok": True, "result": session_op(session, call["op"], call["args"])}
            except _Captured as captured:
                items.append((i, call["op"], captured.item))
            except OperationError as exc:
                outcomes[i] = _failed(exc)
    finally:
        resource.scheduler = scheduler
    for group in _passes([item for _, _, item in items]):
        scheduler._count(len(group))
        scheduler.recent.append(tuple(item.session.id for item in group))
        if len(group) == 1:
            _alone(group[0])
        else:
            run_merged(group)
    for i, op, item in items:
        if item.error is not None:
            if not isinstance(item.error, OperationError):
                raise item.error  # not in step across ranks: the command fails (broken)
            outcomes[i] = _failed(item.error)
        else:
            outcomes[i] = {"ok": True, "result": _after(op, item)}
    return [outcome for outcome in outcomes if outcome is not None]


def _passes(items: list[WorkItem]) -> list[list[WorkItem]]:
    """Forward-backward calls as one pass and forward-only ones as another (first arrival
    first), each cut at `merge_max_tokens`; a call that does not fit runs alone."""
    groups: list[list[WorkItem]] = []
    for mode in dict.fromkeys(item.forward_only for item in items):
        current: list[WorkItem] = []
        tokens = 0
        for item in (item for item in items if item.forward_only == mode):
            if not _fits(item):
                groups.append([item])
                continue
            if current and tokens + item.tokens > item.session.options.merge_max_tokens:
                groups.append(current)
                current, tokens = [], 0
            current.append(item)
            tokens += item.tokens
        if current:
            groups.append(current)
    return groups


def _alone(item: WorkItem) -> None:
    try:
        item.result = item.session._run_alone(
            item.prepared, item.fn, item.forward_only, item.return_outputs
        )
    except OperationError as exc:
        item.fail(exc)


def _after(op: str, item: WorkItem) -> dict[str, Any]:
    """What the session's method does with `_run`'s result (`TrainingSession.forward_backward`,
    `custom_forward_backward`)."""
    assert item.result is not None
    if op == "custom_forward_backward":
        return {}
    session, result = item.session, item.result
    if session.tracker is not None and not item.forward_only:
        metrics = {f"train/{k}": v for k, v in result["metrics"].items()}
        session.tracker.log(session.step, {"train/loss": result["loss"], **metrics})
    return result


@dataclass
class _Pending:
    session_id: str
    op: str
    args: dict[str, Any]
    result: Any = None
    error: BaseException | None = None
    done: bool = False
    taken: bool = False


def _take_all(pending: deque[_Pending]) -> list[_Pending]:
    """Every pending call: each is its own session's (a session waits for its call)."""
    taken = list(pending)
    pending.clear()
    return taken


class DistributedMerger:
    """Rank 0, one per `DistributedResource`: combines concurrent mergeable calls into one
    `merged_pass` command."""

    def __init__(
        self, resource_id: str, local: ModelResource, send: Callable[[dict[str, Any]], Any]
    ) -> None:
        self.resource_id = resource_id
        self.local = local
        self.send = send
        self._combiner: Combiner[_Pending] = Combiner()
        self._model_dropout: bool | None = None

    def wants(self, session: TrainingSession, op: str) -> bool:
        options = session.options
        if op not in MERGEABLE or not options.merge or not getattr(self.local, "lora", False):
            return False
        config = getattr(session.policy, "config", None)
        if config is None or float(config.dropout) > 0:
            return False
        if not getattr(session.policy, "segmentable", True):
            return False  # LoRA on MoE experts: `segmented` handles module layers only
        if self._model_dropout is None:
            self._model_dropout = _model_has_dropout(session.policy.model.config)
        if self._model_dropout:
            return False
        return sum(1 for other in self.local.sessions.values() if other.active) >= 2

    def run(self, session_id: str, op: str, args: dict[str, Any], window_ms: float) -> Any:
        pending = _Pending(session_id, op, args)
        self._combiner.submit(pending, window_ms / 1000.0, _take_all, self._send)
        if pending.error is not None:
            raise pending.error
        return pending.result

    def _send(self, taken: list[_Pending]) -> None:
        try:
            if len(taken) == 1:
                one = taken[0]
                command = {
                    "op": one.op,
                    "resource": self.resource_id,
                    "session": one.session_id,
                    "args": one.args,
                }
                one.result = self.send(command)
                return
            calls = [{"session": p.session_id, "op": p.op, "args": p.args} for p in taken]
            outcomes = self.send({"op": MERGED_OP, "resource": self.resource_id, "calls": calls})
            for pending, outcome in zip(taken, outcomes, strict=True):
                if outcome["ok"]:
                    pending.result = outcome["result"]
                else:
                    code, message, field = outcome["code"], outcome["message"], outcome["field"]
                    pending.error = OperationError(code, message, field)
        except BaseException as exc:
            for pending in taken:
                if pending.result is None and pending.error is None:
                    pending.error = exc
