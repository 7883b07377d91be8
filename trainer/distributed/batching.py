"""Shared passes under torchrun: rank 0's combiner of concurrent calls and the command every
rank runs.

Rank 0. Each session's operations run one at a time on its queue thread and reach its
`DistributedSession`; a forward-backward or custom forward-backward call that may share a pass
(`eligibility.can_share`: a LoRA session, merging on, no dropout, another live session on the
resource) goes to the resource's `DistributedBatcher` instead of being sent alone. The batcher
combines flat, as `trainer/engine/batching/pass_scheduler.py` does in one process: the first
waiting thread waits `merge_window_ms`, takes every pending call (one per session by
construction) and sends them as ONE command, `pass_group`, naming each call's session,
operation and JSON arguments. A group of one is sent as the plain command. Sessions not in the
group are untouched; operations that change weights never come here (barriers for their own
session only).

Every rank (`run_group`, from `spmd.Executor`). Each call's session builds its work item as its
operation would (`TrainingSession.work_item`: the solo validation), without running it. Then,
in call order, forward-backward calls and forward-only calls form one pass each
(`merge_max_tokens` per pass; a call that may not share a pass, such as one that needs more
than one micro-batch, runs in a pass of its own) through `train_pass.run_pass`, the same engine
path as one process: each rank its share of each call's samples, the FSDP root, one report
exchange, global failures and finite checks, replicated gradients summed. Every rank decides the
same groups from the same command, so the collectives stay in step.

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

from trainer.contract.errors import OperationError
from trainer.engine.batching.combine import Combiner
from trainer.engine.batching.eligibility import can_share
from trainer.engine.batching.train_pass import run_pass
from trainer.engine.batching.work import WorkItem
from trainer.engine.session import TrainingSession

if TYPE_CHECKING:
    from trainer.engine.resource import ModelResource

PASS_GROUP_OP = "pass_group"

Outcome = dict[str, Any]


def _failed(exc: OperationError) -> Outcome:
    return {"ok": False, "code": exc.code, "message": exc.message, "field": exc.field}


def run_group(
    resource: ModelResource,
    calls: list[dict[str, Any]],
    work_item: Callable[[TrainingSession, str, dict[str, Any]], WorkItem],
) -> list[Outcome]:
    """Every rank: the calls of one `pass_group` command; one outcome per call,
    `{"ok": True, "result": ...}` or `{"ok": False, "code", "message", "field"}`. `work_item`
    builds one call's item from its JSON arguments (`spmd._work_item`: passed in, so this
    module does not import the command stream that imports it)."""
    outcomes: list[Outcome | None] = [None] * len(calls)
    items: list[tuple[int, WorkItem]] = []
    for i, call in enumerate(calls):
        session = resource.sessions.get(call["session"])
        if session is None:
            message = f"session {call['session']} is not running"
            outcomes[i] = _failed(OperationError("SESSION_NOT_ACTIVE", message))
            continue
        try:
            items.append((i, work_item(session, call["op"], call["args"])))
        except OperationError as exc:
            outcomes[i] = _failed(exc)
    for group in _passes([item for _, item in items]):
        resource.scheduler.record(group)
        run_pass(group)
    for i, item in items:
        if item.error is not None:
            if not isinstance(item.error, OperationError):
                raise item.error  # not in step across ranks: the command fails (broken)
            outcomes[i] = _failed(item.error)
        else:
            outcomes[i] = {"ok": True, "result": item.outcome()}
    return [outcome for outcome in outcomes if outcome is not None]


def _passes(items: list[WorkItem]) -> list[list[WorkItem]]:
    """Forward-backward calls as one pass and forward-only ones as another (first arrival
    first), each cut at `merge_max_tokens`; a call that may not share a pass runs alone."""
    groups: list[list[WorkItem]] = []
    for mode in dict.fromkeys(item.forward_only for item in items):
        current: list[WorkItem] = []
        tokens = 0
        for item in (item for item in items if item.forward_only == mode):
            if not can_share(item.session, "pass", item.prepared):
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


class DistributedBatcher:
    """Rank 0, one per `DistributedResource`: combines concurrent calls that may share a pass
    into one `pass_group` command."""

    def __init__(self, resource_id: str, send: Callable[[dict[str, Any]], Any]) -> None:
        self.resource_id = resource_id
        self.send = send
        self._combiner: Combiner[_Pending] = Combiner()

    @staticmethod
    def wants(session: TrainingSession, op: str) -> bool:
        """Whether rank 0's call `op` of `session` goes to the combiner."""
        return op in TrainingSession.PASS_OPERATIONS and can_share(session, "pass")

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
            group = {"op": PASS_GROUP_OP, "resource": self.resource_id, "calls": calls}
            outcomes = self.send(group)
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
