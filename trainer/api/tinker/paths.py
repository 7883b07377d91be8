"""`tinker://<run>/<weights|sampler_weights>/<name>` paths and the checkpoints they name.

A checkpoint saved through the Tinker API is recorded under its path (`save_weights` ->
`weights/<name>`, a training checkpoint; `save_weights_for_sampler` -> `sampler_weights/<name>`,
an inference checkpoint; `save_weights_external` -> `external_weights/<name>`, an inference
checkpoint holding the LoRA adapter alone, in Tinker's naming and optionally age-encrypted,
whose files download through signed URLs). A checkpoint saved through the RL session API has
the path
`tinker://<training session id>/<segment>/<checkpoint id>`, so either face resumes, lists and
downloads what the other saved.
"""

from __future__ import annotations

import re

from trainer.api.tinker.bridge import TinkerBridge
from trainer.api.tinker.records import TinkerCheckpoint
from trainer.checkpoint.export import ENCRYPTED_EXPORT, stored_encrypted
from trainer.checkpoint.store import INFERENCE, TRAINING, CheckpointRecord
from trainer.serving.errors import ApiError, bad_request
from trainer.serving.ownership import owned
from trainer.serving.tenants import Principal

SEGMENTS = {"training": "weights", "sampler": "sampler_weights", "external": "external_weights"}
KINDS = {segment: kind for kind, segment in SEGMENTS.items()}
ENGINE_TYPES = {"training": TRAINING, "sampler": INFERENCE, "external": INFERENCE}
PREFIX = "tinker://"
NAME_MAX = 200

TINKER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_:-]{0,255}$")
"""Tinker ids: our safe ids plus ':' (`<session>:train:<seq>`); no '/', '.', or '..'. A path
parameter of the face's routes, and each part of a checkpoint id, is one."""


def make(run_id: str, kind: str, name: str) -> str:
    return f"{PREFIX}{run_id}/{SEGMENTS[kind]}/{name}"


def parse(path: str, field: str) -> tuple[str, str, str]:
    """(run id, kind, name) of a tinker path; a 400 naming `field` when it is not one."""
    parts = path[len(PREFIX) :].split("/") if path.startswith(PREFIX) else []
    if len(parts) != 3 or not parts[0] or not parts[2] or parts[1] not in KINDS:
        raise bad_request(
            f"{field}: {path!r} is not a tinker path (tinker://<run>/<weights|sampler_weights|"
            "external_weights>/<name>)",
            field,
        )
    return parts[0], KINDS[parts[1]], parts[2]


def check_name(name: str, field: str) -> str:
    """A checkpoint name that every route can address (list, sign, delete: a Tinker id of at
    most `NAME_MAX` characters); a 400 naming `field` otherwise."""
    if len(name) > NAME_MAX or not TINKER_ID.fullmatch(name):
        shown = name if len(name) <= NAME_MAX else f"{name[:40]}... ({len(name)} characters)"
        raise bad_request(
            f"{field}: {shown!r} is not a checkpoint name (1-{NAME_MAX} letters, digits, '_', "
            "'-' or ':', starting with a letter or digit)",
            field,
        )
    return name


def resolve(
    bridge: TinkerBridge, path: str, field: str, who: Principal, write: bool = False
) -> CheckpointRecord:
    """The engine checkpoint a tinker path names, one `who` may read: its own, or a published
    one (`routes_publish`); with `write`, its own only. Another user's (unpublished, or any
    with `write`) is the 404 of a missing one."""
    run_id, kind, name = parse(path, field)
    saved = bridge.db.get(TinkerCheckpoint, path)
    checkpoint_id = saved.checkpoint_id if saved is not None else name
    record = bridge.worker.checkpoints.get(checkpoint_id)
    if record is not None and saved is None and record.session_id != run_id:
        record = None  # an RL-face checkpoint under another run's name names nothing
    public = not write and saved is not None and saved.public
    record = owned(
        record,
        who,
        "checkpoint",
        path,
        field,
        owner=bridge.worker.checkpoint_owner,
        shared=lambda _: public,
    )
    if record.type != ENGINE_TYPES[kind]:
        raise ApiError(400, f"{field}: {path!r} names a checkpoint of another kind", param=field)
    return record


def loadable(bridge: TinkerBridge, path: str, field: str, who: Principal) -> CheckpointRecord:
    """`resolve`, for a checkpoint the worker will read back: an encrypted export (its files
    age-encrypted to the user's recipients) is a 400 naming `field`."""
    record = resolve(bridge, path, field, who)
    if stored_encrypted(bridge.worker.checkpoints, record.id):
        raise bad_request(f"{field}: {path} {ENCRYPTED_EXPORT}", field)
    return record


def published(bridge: TinkerBridge, path: str) -> bool:
    """Whether the tinker path is a published checkpoint (readable by every user)."""
    saved = bridge.db.get(TinkerCheckpoint, path)
    return saved is not None and saved.public


def shares(bridge: TinkerBridge, record: CheckpointRecord) -> bool:
    """Whether an engine checkpoint is readable by every user: one of its tinker paths is
    published (the worker's `checkpoint_shared`: resumes and signed downloads)."""
    where = "checkpoint_id = ? AND scope IS NULL AND public = 1"
    return bridge.db.count(TinkerCheckpoint, where, (record.id,)) > 0


def path_of(bridge: TinkerBridge, record: CheckpointRecord) -> str:
    """The tinker path of an engine checkpoint (its Tinker name when saved through Tinker)."""
    rows = bridge.db.select(TinkerCheckpoint, "checkpoint_id = ? AND scope IS NULL", (record.id,))
    if rows:
        return rows[0].path
    kind = "training" if record.type == TRAINING else "sampler"
    return make(record.session_id, kind, record.id)
