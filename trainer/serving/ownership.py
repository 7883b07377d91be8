"""One ownership check for every reference a request makes, on every face.

A client names objects in many ways: an id in a path, a query parameter (a listing's `after`
cursor, a `session_id` filter), a body field (`model_resources_id`, `resume_from_checkpoint_id`,
`base_weights_ref`, Tinker's `model_id`, `sampling_session_id`, `request_id`), a `tinker://`
path, a local directory (`resume_from_hf_checkpoint`), a sampler id (ad hoc or not), a signed
URL. Each lookup goes through `owned` (or `usable_cursor`, `in_storage`), so the rule is
written once (docs/semantics.md §21):

- an object belongs to the user who made it; an admin sees every object; one made before owners
  were recorded (owner None) is an admin's alone (`Principal.sees`);
- another user's object answers exactly as a missing one: `owned` raises the very `not_found` a
  missing id raises, same status, message and field, so no answer tells that an id exists;
- a listing's cursor that is not the caller's object is treated as a missing cursor;
- a local path that resolves into the worker's storage is the storage's object, named by id
  only: `resume_from_hf_checkpoint` refuses it whatever the spelling (`in_storage`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from trainer.serving.errors import not_found
from trainer.serving.tenants import Principal

T = TypeVar("T")


def _owner_column(found: Any) -> str | None:
    owner = getattr(found, "owner", None)
    return owner if isinstance(owner, str) else None


def visible(who: Principal | None, owner: str | None, shared: bool = False) -> bool:
    """Whether `who` may name an object of `owner` (`who` None: the worker itself)."""
    return who is None or shared or who.sees(owner)


def owned(
    found: T | None,
    who: Principal | None,
    what: str,
    ident: str,
    field: str | None,
    owner: Callable[[T], str | None] = _owner_column,
    shared: Callable[[T], bool] = lambda _: False,
) -> T:
    """`found` when it exists and `who` may name it; otherwise the 404 of a missing `what`
    (the same for "not there" and "not yours")."""
    if found is None or not visible(who, owner(found), shared(found)):
        raise not_found(what, ident, field)
    return found


def usable_cursor(
    found: T | None,
    who: Principal | None,
    owner: Callable[[T], str | None] = _owner_column,
    shared: Callable[[T], bool] = lambda _: False,
) -> bool:
    """Whether a listing may continue after `found`: a cursor `who` may not name is a missing
    one (its position would tell its age, and that it exists)."""
    return found is not None and visible(who, owner(found), shared(found))


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def in_storage(path: Path, storage: Path) -> bool:
    """Whether a local path names something inside the storage directory: lexically (`..`
    collapsed, trailing slashes dropped) or once its symlinks resolve, whether or not it
    exists, against the storage's own spelling and its resolved one."""
    roots = {os.path.abspath(storage), str(storage.resolve())}
    spellings = {os.path.abspath(path), str(path.resolve())}
    return any(_inside(s, r) for s in spellings for r in roots)
