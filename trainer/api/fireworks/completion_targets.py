"""The completions' resolvers of checkpoints, promoted models and base models (`targets.py`).

A completion's `model` may name, besides a deployment (whose resolver `deployments` registers):
- a base model of the catalogue (`accounts/fireworks/models/qwen3-tiny`): the base model;
- a model promoted in the caller's account (`accounts/<a>/models/<m>`): its checkpoint;
- a checkpoint saved through any face: a `tinker://` path (the Tinker face's, or an RL-session
  checkpoint's `tinker://<session>/<segment>/<checkpoint id>`), a Fireworks logical sampler path
  (`<account>/run-<32 hex>/<name>`), or an RL-session checkpoint id itself;
- on the serverless surface (`serverless.py`): a training session of the caller's
  (`accounts/<a>/trainingSessions/<ts>`: its base model), one of its checkpoints
  (`.../checkpoints/<account>/run-<32 hex>/<name>`, the sampler path its run saved, or
  `.../checkpoints/<run id>-<name>`, the control plane's row), and a standalone sampler
  (`accounts/<a>/trainingSamplers/checkpoints/<sampler path>`, `accounts/<a>/trainingSamplers/
  <base model>`).

A LoRA checkpoint (or the base model) samples on an engine session of the Tinker face's sampler
pool (`SamplerSessions`): opened from the checkpoint's weights on the shared LoRA resource of its
base model, shared with the Tinker face's samplers of the same checkpoint, released after the
completion (the pool closes it when idle). A full-weight checkpoint is refused (400 naming
`model`): it would need a resource of its own per checkpoint. A name of another account answers
exactly as a missing one (the 404 of `Targets.resolve`).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from trainer.api.fireworks import serverless
from trainer.api.fireworks.records import model_path
from trainer.api.fireworks.service import FireworksFace
from trainer.api.fireworks.targets import Target
from trainer.api.tinker import names, paths
from trainer.api.tinker.bridge import TinkerBridge
from trainer.api.tinker.records import TinkerCheckpoint, TinkerModel, TinkerSampler
from trainer.api.tinker.sampling import SamplerSessions, adhoc_id, new_sampler
from trainer.checkpoint.export import ENCRYPTED_EXPORT, stored_encrypted
from trainer.checkpoint.store import CheckpointRecord
from trainer.serving.errors import ApiError, bad_request
from trainer.serving.tenants import Principal

FIELD = "model"
ROW_ID = re.compile(r"^(run-[0-9a-f]{32})-(.+)$")


def missing(name: str) -> ApiError:
    """The one answer for a name that names nothing the caller may sample."""
    return ApiError(404, f"model: {name!r} not found", param=FIELD, code="not_found")


def _full_weight(name: str) -> ApiError:
    return bad_request(
        f"model: {name!r} is a full-weight checkpoint; completions name LoRA checkpoints and "
        "base models directly; hot-load a full-weight one into a deployment "
        "(/hot_load/v1/models/hot_load) and name the deployment",
        FIELD,
    )


class CompletionTargets:
    """The resolvers, bound to the Tinker face's bridge and sampler pool."""

    def __init__(self, face: FireworksFace, bridge: TinkerBridge, pool: SamplerSessions) -> None:
        self.face = face
        self.bridge = bridge
        self.pool = pool

    def resolvers(self) -> list[Callable[[str, Principal], Target | None]]:
        return [
            self.base_model,
            self.promoted,
            self.tinker_path,
            self.logical,
            self.rl_checkpoint,
            self.training_session,
            self.training_sampler,
        ]

    # -- what a name is ---------------------------------------------------------------------

    def base_model(self, name: str, who: Principal) -> Target | None:
        entry = self.bridge.worker.config.model(name)
        if entry is None:
            return None
        sampler = new_sampler(self.bridge, adhoc_id(who, name), "", entry.name, None, who, False)
        return self._target(name, sampler)

    def promoted(self, name: str, who: Principal) -> Target | None:
        if model_path(name) is None:
            return None
        model = self.face.records.own_model(name, who.user)
        if model is None:
            raise missing(name)
        if not model.lora_rank:
            raise _full_weight(name)
        record = self.bridge.worker.checkpoints.get(model.checkpoint_id)
        if record is None:
            raise missing(name)
        return self._checkpoint(name, record, who)

    def tinker_path(self, name: str, who: Principal) -> Target | None:
        if not name.startswith(paths.PREFIX):
            return None
        try:
            record = paths.resolve(self.bridge, name, FIELD, who)
        except ApiError as exc:
            if exc.status == 404:
                raise missing(name) from None
            raise
        return self._checkpoint(name, record, who)

    def logical(self, name: str, who: Principal) -> Target | None:
        parts = name.split("/")
        if not (
            len(parts) == 3
            and names.RUN_ID.fullmatch(parts[1])
            and names.DNS_LABEL.fullmatch(parts[2])
        ):
            return None
        if parts[0] not in (who.user, names.account_of(who, None)):
            raise missing(name)
        saved = self.bridge.db.get(TinkerCheckpoint, name)
        record = None if saved is None else self.bridge.worker.checkpoints.get(saved.checkpoint_id)
        if record is None:
            raise missing(name)
        return self._checkpoint(name, record, who)

    def rl_checkpoint(self, name: str, who: Principal) -> Target | None:
        """An RL-session checkpoint id (`/v1/rl/checkpoints/{id}`); tried last."""
        if "/" in name or ":" in name:
            return None
        record = self.bridge.worker.checkpoints.get(name)
        if record is None:
            return None
        return self._checkpoint(name, record, who)

    def training_session(self, name: str, who: Principal) -> Target | None:
        """`accounts/<a>/trainingSessions/<ts>[/checkpoints/<c>]`: a checkpoint that one of
        the session's runs saved, or the base model of the session's models."""
        parts = name.split("/")
        if len(parts) < 4 or parts[0] != "accounts" or parts[2] != "trainingSessions":
            return None
        session_id, rest = parts[3], parts[4:]
        mine = parts[1] == who.user
        if not mine or serverless.session_of(self.bridge.db, who, session_id) is None:
            raise missing(name)
        if not rest:
            held = self.bridge.db.select(TinkerModel, "tinker_session = ?", (session_id,))
            if not held:
                raise missing(name)
            return self.base_model(held[0].base_model, who)
        if rest[0] != "checkpoints" or len(rest) < 2:
            raise missing(name)
        account = names.account_of(who, None)
        path = "/".join(rest[1:])
        row_id = ROW_ID.fullmatch(path)  # the control plane's `<run id>-<name>`
        if row_id is not None:
            path = f"{account}/{row_id.group(1)}/{row_id.group(2)}"
        saved = self.bridge.db.get(TinkerCheckpoint, path)
        scope = serverless.session_scope(account, session_id)
        if saved is None or not (saved.scope or "").startswith(scope):
            raise missing(name)
        record = self.bridge.worker.checkpoints.get(saved.checkpoint_id)
        if record is None:
            raise missing(name)
        return self._checkpoint(name, record, who)

    def training_sampler(self, name: str, who: Principal) -> Target | None:
        """`accounts/<a>/trainingSamplers/checkpoints/<sampler path>` (a checkpoint of any
        run of the caller's) or `accounts/<a>/trainingSamplers/<base model>`."""
        parts = name.split("/", 3)
        if len(parts) < 4 or parts[0] != "accounts" or parts[2] != "trainingSamplers":
            return None
        if parts[1] != who.user:
            raise missing(name)
        rest = parts[3]
        try:
            if rest.startswith("checkpoints/"):
                found = self.logical(rest.removeprefix("checkpoints/"), who)
            else:
                found = self.base_model(rest, who)
        except ApiError as exc:
            if exc.status == 404:
                raise missing(name) from None
            raise
        if found is None:
            raise missing(name)
        return found

    # -- the engine session -----------------------------------------------------------------

    def _checkpoint(self, name: str, record: CheckpointRecord, who: Principal) -> Target:
        worker = self.bridge.worker
        try:  # its owner's, or shared with `who` (`Worker.checkpoint`)
            record = worker.checkpoint(record.id, who, FIELD)
        except ApiError as exc:
            if exc.status == 404:
                raise missing(name) from None
            raise
        if stored_encrypted(worker.checkpoints, record.id):
            raise bad_request(f"model: {name} {ENCRYPTED_EXPORT}", FIELD)
        if not record.lora_rank:
            raise _full_weight(name)
        entry = self.bridge.entry(record.base_model, FIELD)
        sampler = TinkerSampler(
            id=adhoc_id(who, name),
            tinker_session="",
            base_model=entry.name,
            created_at=0.0,
            model_path=name,
            checkpoint_id=record.id,
            owner=who.user,
        )
        return self._target(name, sampler)

    def _target(self, name: str, sampler: TinkerSampler) -> Target:
        key, session_id = self.pool.acquire(sampler)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.pool.release(key)

        return Target(
            name=name,
            base_model=sampler.base_model,
            session_id=session_id,
            identity=sampler.model_path,
            release=release,
        )


def register(face: FireworksFace, bridge: TinkerBridge, pool: SamplerSessions) -> None:
    """Register the resolvers on the face's `targets`."""
    for resolver in CompletionTargets(face, bridge, pool).resolvers():
        face.targets.register(resolver)
