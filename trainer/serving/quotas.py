"""A user's quotas (`tenants.Quotas`) checked against the worker's records.

- `max_resources`, `max_sessions`: the live objects a user owns, counted with the insert under
  the lock that guards it (`check_live_quota`), so racing creates never pass the cap;
- `max_storage_bytes`: the bytes of a user's checkpoints and payloads (`storage_used`), checked
  after a checkpoint save, which is undone when it went past (`within_storage`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainer.checkpoint.store import CheckpointCorrupt, CheckpointStore
from trainer.contract.errors import OperationError
from trainer.serving.catalogue import Catalogue, ResourceRow, SessionRow
from trainer.serving.payloads import PayloadFiles
from trainer.serving.queues import EngineCall
from trainer.serving.tenants import QUOTA_PREFIX, over_quota


def check_live_quota(
    store: Catalogue,
    kind: type[ResourceRow] | type[SessionRow],
    owner: str,
    name: str,
    limit: int | None,
) -> None:
    """The quota `name` on `owner`'s live objects of `kind` (None: unlimited) leaves no room
    for one more: a 429 naming it."""
    if limit is None:
        return
    used = store.count_live_owned(kind, owner)
    if used >= limit:
        raise over_quota(name, limit, used)


def storage_used(
    store: Catalogue, checkpoints: CheckpointStore, payloads: PayloadFiles, user: str
) -> int:
    """Bytes on disk of `user`'s checkpoints (of every session it opened) and payloads."""
    session_ids = store.session_ids_of(user)
    total = 0
    for record in checkpoints.list(session_ids=session_ids, limit=1 << 30):
        try:
            total += sum(f.size for f in checkpoints.manifest_files(record.id))
        except (KeyError, CheckpointCorrupt):
            continue
    return total + sum(payloads.session_bytes(s) for s in session_ids)


def within_storage(
    call: EngineCall,
    owner: str | None,
    limit: int | None,
    used_by: Callable[[str], int],
    delete: Callable[[str], object],
) -> EngineCall:
    """`call` (a checkpoint save) such that, when it leaves `owner` past its
    `max_storage_bytes` (`limit`, as `used_by` counts), it is undone (its checkpoint deleted)
    and FAILs RESOURCE_EXHAUSTED naming the quota."""
    if limit is None or owner is None:
        return call

    def checked(engine: Any) -> dict[str, Any]:
        out = call(engine)
        used = used_by(owner)
        if used > limit:
            checkpoint_id = str((out.get("checkpoint") or {}).get("id") or "")
            if checkpoint_id:
                delete(checkpoint_id)
            raise OperationError(
                "RESOURCE_EXHAUSTED",
                f"{QUOTA_PREFIX}max_storage_bytes: the checkpoint would bring {owner}'s "
                f"checkpoints and payloads to {used} bytes, past {limit}; delete some first",
            )
        return out

    return checked
