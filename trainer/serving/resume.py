"""What a new session resumes from, checked before anything is recorded.

- `resume_from_checkpoint_id`: one of the worker's checkpoints that the caller may see
  (`ownership.owned`: another user's is the 404 of a missing one), readable by the worker (not an
  encrypted export), within the resource's `max_lora_rank`.
- `resume_from_hf_checkpoint`: a hub id, or a local directory under a configured
  `resume_roots`. A local path that resolves into the worker's storage is refused, whatever its
  spelling (relative, `..`, symlinks, `file://`, trailing slashes), and whether or not it
  exists: the storage's checkpoints are named by id only (`resume_from_checkpoint_id`), where
  their owner is checked. So one 400 answers for another user's checkpoint and a missing one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

from trainer.checkpoint.export import ENCRYPTED_EXPORT, stored_encrypted
from trainer.contract.specs import ModelEntry
from trainer.serving.errors import bad_request
from trainer.serving.ownership import in_storage
from trainer.serving.requests import CreateSessionBody
from trainer.serving.tenants import Principal

if TYPE_CHECKING:
    from trainer.serving.lifecycle import LiveResource

HF_FIELD = "resume_from_hf_checkpoint"
ID_FIELD = "resume_from_checkpoint_id"
_LOCAL_PREFIXES = ("/", "./", "../", "~", ".\\")
FILE_SCHEME = "file://"


def _file_url_path(location: str) -> str:
    """The local path of a `file://` URL (a host other than localhost is a 400)."""
    parts = urlsplit(location)
    if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
        raise bad_request(
            f"{HF_FIELD}: {location[:200]!r}: a file:// URL names a local directory "
            "(file:///path), with no host, query or fragment",
            HF_FIELD,
        )
    return unquote(parts.path) or "/"


def _hub_shaped(location: str) -> bool:
    """A hub id is `name` or `org/name` (or `hf://...`), decided by its spelling alone, never by
    what exists on disk; any other spelling is a local path (`/abs`, `./rel`, `a/b/c`)."""
    if location.startswith("hf://"):
        return True
    if location.startswith(_LOCAL_PREFIXES) or ".." in Path(location).parts:
        return False
    return location.rstrip("/").count("/") <= 1


def resume_location(location: str, storage: Path, roots: list[Path]) -> str:
    """The location the engine reads for `resume_from_hf_checkpoint`: a hub id (as
    `hf://org/name`, so the engine never reads a local directory of that name), or a local
    directory under `roots` (a `file://` URL as its path). A 400 naming the field for a path
    inside `storage` (named by id only), outside `roots`, or unusable."""
    forced = location.lower().startswith(FILE_SCHEME)
    if not forced and _hub_shaped(location):
        return location if location.startswith("hf://") else f"hf://{location}"
    text = _file_url_path(location) if forced else location
    try:  # NUL, names past NAME_MAX, unreadable parents, symlink loops: the client's value
        path = Path(text).expanduser()
        stored = in_storage(path, storage)
        resolved = path.resolve()
    except (OSError, ValueError, RuntimeError) as exc:
        message = f"{HF_FIELD}: cannot use {location[:200]!r} as a location: {exc}"
        raise bad_request(message, HF_FIELD) from None
    if stored:
        raise bad_request(
            f"{HF_FIELD}: {location[:200]!r} is inside this worker's storage, whose checkpoints "
            f"are named by id only: resume one with {ID_FIELD} (the ids GET /v1/rl/checkpoints "
            "lists)",
            HF_FIELD,
        )
    if not any(resolved.is_relative_to(root.resolve()) for root in roots):
        raise bad_request(
            f"{HF_FIELD}: the local directory {location[:200]!r} is outside the directories "
            "this worker may read (`resume_roots`); give a hub id, or configure the directory "
            "in `resume_roots`",
            HF_FIELD,
        )
    return text


def _check_adapter_rank(location: str, entry: ModelEntry) -> None:
    """A local PEFT adapter's rank against the limit before anything is recorded (a hub
    adapter is checked by the engine once downloaded)."""
    config = Path(location).expanduser() / "adapter_config.json"
    try:
        rank = json.loads(config.read_text()).get("r")
    except (OSError, ValueError, AttributeError):
        return  # not a local adapter (or unreadable): the engine reports it
    if isinstance(rank, int) and rank > entry.max_lora_rank:
        raise bad_request(
            f"{HF_FIELD}: the adapter at {location!r} has LoRA rank {rank}, over max_lora_rank "
            f"{entry.max_lora_rank} of {entry.name}",
            HF_FIELD,
        )


def checked_resume(
    worker: Any, body: CreateSessionBody, who: Principal, live: LiveResource
) -> CreateSessionBody:
    """`body` with what it resumes from checked for `who` (its local location as the engine
    reads it); a 404 or 400 naming the field otherwise."""
    lora_enabled = live.spec.lora_enabled
    if body.resume_from_checkpoint_id:
        ident = body.resume_from_checkpoint_id
        record = worker.checkpoint(ident, who, ID_FIELD)
        if stored_encrypted(worker.checkpoints, record.id):
            raise bad_request(f"{ID_FIELD}: checkpoint {record.id} {ENCRYPTED_EXPORT}", ID_FIELD)
        limit = live.entry.max_lora_rank
        if lora_enabled and record.lora_rank is not None and record.lora_rank > limit:
            raise bad_request(
                f"{ID_FIELD}: checkpoint {record.id} has LoRA rank {record.lora_rank}, over "
                f"max_lora_rank {limit} of {live.entry.name}",
                ID_FIELD,
            )
    if body.resume_from_hf_checkpoint:
        config = worker.config
        location = resume_location(
            body.resume_from_hf_checkpoint, config.storage, list(config.resume_roots)
        )
        if lora_enabled:
            _check_adapter_rank(location, live.entry)
        if location != body.resume_from_hf_checkpoint:
            body = body.model_copy(update={HF_FIELD: location})
    return body
