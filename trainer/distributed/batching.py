"""Shared passes under torchrun: rank 0's combiner of concurrent calls and the command every
rank runs.

Design notes: `docs/design/distributed.md`.
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
