"""Logical checkpoint names: the Fireworks SDK's way to name what `save_state` and
`save_weights_for_sampler` wrote (its `_validate_checkpoint_ref` refuses every `scheme://`
path, `tinker://` included).

A name lives in a name space (`scope_of`): the gateway's job (`Binding.scope`) for a bound
model, else the model itself. The name space has a run id, `run-<32 hex>` (a digest of the
scope), and each saved name is recorded (in `tinker.sqlite`'s path table, beside the
checkpoint's `tinker://` path) under its canonical path `<account>/run-<32 hex>/<name>`:
the `path` a save returns to the Fireworks SDK, loadable from anywhere by its account. A load
takes, as the SDK does (docs/semantics.md §23):
- a bare DNS label (`step-4`): a name of the model's own name space;
- `<account>/run-<32 hex>/<name>`: a canonical path, of the caller's account only;
- `cross_job://<job>/<name>`: a name of another job of the caller's account.
Another account's name answers exactly as a missing one.
"""

from __future__ import annotations

import hashlib
import re
import time

from trainer.api.tinker.binding import Binding
from trainer.api.tinker.bridge import TinkerBridge
from trainer.api.tinker.records import TinkerCheckpoint, TinkerModel
from trainer.checkpoint.store import CheckpointRecord
from trainer.serving.errors import ApiError, bad_request
from trainer.serving.ownership import owned
from trainer.serving.tenants import Principal

CROSS_JOB = "cross_job://"
DNS_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
RUN_ID = re.compile(r"^run-[0-9a-f]{32}$")
FIRETITAN_AGENT = "AsyncTinker/Python 0.23"  # the Fireworks SDK's vendored Tinker client


def account_of(who: Principal, binding: Binding | None) -> str:
    """The account of the caller's names: the job's, or its user as a DNS label (a user id
    that is not one becomes `u-<digest>`)."""
    if binding is not None:
        return binding.account
    user = who.user.lower()
    if DNS_LABEL.fullmatch(user):
        return user
    return "u-" + hashlib.sha256(who.user.encode()).hexdigest()[:24]


def scope_of(model: TinkerModel) -> str:
    return model.scope or f"model:{model.id}"


def run_id(scope: str) -> str:
    return "run-" + hashlib.sha256(scope.encode()).hexdigest()[:32]


def canonical(account: str, scope: str, name: str) -> str:
    return f"{account}/{run_id(scope)}/{name}"


def check_label(name: str, field: str) -> str:
    if not DNS_LABEL.fullmatch(name):
        raise bad_request(
            f"{field}: {name[:80]!r} is not a checkpoint name of the Fireworks SDK (a DNS label: "
            "1-63 lower-case letters, digits or '-', starting and ending with a letter or digit)",
            field,
        )
    return name


def is_logical(path: str) -> bool:
    """Whether a load's `path` is a logical name (every `tinker://` path is not)."""
    return not path.startswith("tinker://")


def record(
    bridge: TinkerBridge,
    account: str,
    model: TinkerModel,
    kind: str,
    name: str,
    checkpoint_id: str,
    merged: bool = False,
) -> str:
    """Record `name` (a DNS label) of `model`'s name space for an engine checkpoint (`merged`:
    a `merged_base` sampler save); its canonical path. A name saved again names the newer
    checkpoint."""
    scope = scope_of(model)
    path = canonical(account, scope, name)
    bridge.db.insert(
        TinkerCheckpoint(
            path=path,
            run_id=model.id,
            kind=kind,
            name=name,
            checkpoint_id=checkpoint_id,
            created_at=time.time(),
            scope=scope,
            merged=merged,
        ),
        replace=True,
    )
    return path


def _missing(ref: str, field: str) -> ApiError:
    return bad_request(f"{field}: no checkpoint named {ref[:300]!r} on this worker", field)


def canonical_of(ref: str, field: str, account: str, scope: str | None) -> str:
    """The canonical path a load's logical `ref` names, for the caller's `account` and the
    target model's name space `scope` (None: a model not made yet, which has none); a 400
    naming `field` when `ref` is no logical name, or names another account's."""
    ref = ref.strip()
    if ref.startswith(CROSS_JOB):
        job, _, name = ref[len(CROSS_JOB) :].partition("/")
        if not DNS_LABEL.fullmatch(job) or not DNS_LABEL.fullmatch(name):
            raise bad_request(f"{field}: expected {CROSS_JOB}<job>/<name>, two DNS labels", field)
        return canonical(account, f"job:{account}/{job}", name)
    parts = ref.split("/")
    if len(parts) == 1 and DNS_LABEL.fullmatch(ref):
        if scope is None:
            raise _missing(ref, field)
        return canonical(account, scope, ref)
    if len(parts) == 3 and RUN_ID.fullmatch(parts[1]) and DNS_LABEL.fullmatch(parts[2]):
        if parts[0] != account:  # another account's name: as missing as a name never saved
            raise _missing(ref, field)
        return ref
    raise bad_request(
        f"{field}: {ref[:200]!r} is not a checkpoint reference (a name like 'step-4', "
        f"'<account>/run-<32 hex>/<name>', '{CROSS_JOB}<job>/<name>', or a tinker:// path)",
        field,
    )


def resolve(
    bridge: TinkerBridge,
    ref: str,
    field: str,
    who: Principal,
    account: str,
    scope: str | None,
) -> tuple[TinkerCheckpoint, CheckpointRecord]:
    """The recorded name and the engine checkpoint a logical `ref` names, one `who` may see
    (the same 400 as a missing name otherwise)."""
    path = canonical_of(ref, field, account, scope)
    saved = bridge.db.get(TinkerCheckpoint, path)
    record = None if saved is None else bridge.worker.checkpoints.get(saved.checkpoint_id)
    if record is None or saved is None:
        raise _missing(ref, field)
    try:
        record = owned(record, who, "checkpoint", ref, field, owner=bridge.worker.checkpoint_owner)
    except ApiError:
        raise _missing(ref, field) from None
    return saved, record


def listed(bridge: TinkerBridge, account: str, scope: str | None) -> list[str]:
    """The training-state names a `list_checkpoints` answers, each loadable by `load_state`:
    a name space's bare names (`scope`: a bound job's), or every canonical path of the
    account (None: unbound, where a bare name of another model would not load)."""
    if scope is not None:
        rows = bridge.db.select(TinkerCheckpoint, "scope = ? AND kind = ?", (scope, "training"))
        return sorted({row.name for row in rows if row.path.startswith(f"{account}/")})
    rows = bridge.db.select(
        TinkerCheckpoint,
        "scope IS NOT NULL AND kind = ? AND path LIKE ?",
        ("training", f"{account}/%"),
    )
    return sorted(row.path for row in rows if row.path.startswith(f"{account}/"))
