"""Tinker sampling: sampling sessions, `asample`, and the engine sessions that serve them.

A sampling session names what it samples: a `tinker://` checkpoint (saved by either face) or
a base model. Its samples run on an engine session opened from that checkpoint
(`resume_from_checkpoint_id`, weights only) on the shared resource of the base model, or on a
fresh rank-1 LoRA session for the base model itself (its B matrices are zero, so it computes
exactly the base model). Sampling sessions of the same checkpoint share one engine session;
at most `MAX_SAMPLER_SESSIONS` stay open, the least recently used idle one closing first.

A checkpoint that `save_weights_for_sampler` just wrote from a training model is also what that
model's own engine session publishes (the save syncs its weights, `bind`): its samples run on
that session, whose published weights the generator already serves (on vLLM, an adapter
already loaded in the replicas), so no engine session is opened per sampler checkpoint. A
sample that finds the training session's published version moved on (a later save) runs again
on a session opened from the checkpoint, so it always comes from the checkpoint's weights.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool

from trainer.api.auth import principal_of
from trainer.api.http import json_object
from trainer.api.tinker import convert, paths, stability
from trainer.api.tinker.bridge import TinkerBridge, tinker_named
from trainer.api.tinker.convert_inputs import flag
from trainer.api.tinker.identity import request_key
from trainer.api.tinker.records import TinkerSampler
from trainer.api.tinker.requests import CreateSamplingSession
from trainer.api.tinker.routes import (
    bridge_of,
    future_json,
    get_session,
    input_error,
    parse,
    seq_id_of,
    session_owner,
)
from trainer.serving.catalogue import SES_RUNNING, SessionRow
from trainer.serving.errors import ApiError, bad_request
from trainer.serving.operations import (
    OPERATIONS,
    has_tokenizer,
    validated_call,
    vocab_size_of,
)
from trainer.serving.ownership import owned
from trainer.serving.tenants import LOCAL, Principal
from trainer.serving.worker import EngineCall

router = APIRouter()
MAX_SAMPLER_SESSIONS = 4
ADHOC = "adhoc:"


class SamplerSessions:
    """Engine sessions that serve samples, keyed by what they sample (a checkpoint id, or
    `base:<model>`). A session in use is never closed under its user: the use is counted under
    the lock that looks the session up, and eviction passes over keys in use."""

    def __init__(self, bridge: TinkerBridge) -> None:
        self.bridge = bridge
        self.lock = threading.Lock()
        self.open: OrderedDict[str, str] = OrderedDict()  # key -> engine session id
        self.in_use: dict[str, int] = {}  # key -> samples using (or opening) it; absent: 0
        self.opening: dict[str, threading.Lock] = {}  # key -> held while its session opens
        # checkpoint id -> (the training model's engine session, the version it published then)
        self.bound: dict[str, tuple[str, int]] = {}
        self.opened = 0  # engine sessions opened for samplers (tests, metrics)
        bridge.on_sessions_ended.append(self.sessions_ended)

    def bind(self, checkpoint_id: str, session_id: str, version: int) -> None:
        """Samples of `checkpoint_id` may run on `session_id` while it publishes `version`."""
        with self.lock:
            self.bound[checkpoint_id] = (session_id, version)
            for key in [k for k, (s, v) in self.bound.items() if s == session_id and v < version]:
                del self.bound[key]  # older versions of that session: no longer published

    def binding(self, sampler: TinkerSampler) -> tuple[str, int] | None:
        """The training session and version a sample of `sampler` may run on, if any."""
        if not sampler.checkpoint_id:
            return None
        with self.lock:
            bound = self.bound.get(sampler.checkpoint_id)
        if bound is None or not self._running(bound[0]):
            return None
        return bound

    def unbind(self, checkpoint_id: str) -> None:
        with self.lock:
            self.bound.pop(checkpoint_id, None)

    @staticmethod
    def key_of(sampler: TinkerSampler) -> str:
        return sampler.checkpoint_id or f"base:{sampler.base_model}"

    def acquire(self, sampler: TinkerSampler) -> tuple[str, str]:
        """(key, engine session id) for a sample of `sampler`, opening the session if none
        runs; `release(key)` after the sample."""
        key = self.key_of(sampler)
        with self.lock:
            self.in_use[key] = self.in_use.get(key, 0) + 1
            gate = self.opening.setdefault(key, threading.Lock())
        try:
            with gate:
                with self.lock:
                    session_id = self.open.get(key)
                if session_id is None or not self._running(session_id):
                    session_id = self._open(sampler)
                with self.lock:
                    self.open[key] = session_id
                    self.open.move_to_end(key)
        except BaseException:
            self.release(key)
            raise
        self._evict()
        return key, session_id

    def release(self, key: str) -> None:
        with self.lock:
            count = self.in_use.get(key, 1) - 1
            if count > 0:
                self.in_use[key] = count
            else:  # nobody holds its gate either: every holder is counted
                self.in_use.pop(key, None)
                self.opening.pop(key, None)
        self._evict()

    def sessions_ended(self, session_ids: list[str]) -> None:
        """Close the idle engine sessions that only samplers of these ended Tinker sessions
        used (a bridge hook, run by the heartbeat sweep)."""
        db = self.bridge.db
        marks = ", ".join("?" for _ in session_ids)
        ended = db.select(TinkerSampler, f"tinker_session IN ({marks})", tuple(session_ids))
        alive = db.select(
            TinkerSampler, "tinker_session IN (SELECT id FROM sessions WHERE ended_at IS NULL)"
        )
        unused = {self.key_of(s) for s in ended} - {self.key_of(s) for s in alive}
        with self.lock:
            closing = [
                self.open.pop(key)
                for key in unused
                if key in self.open and self.in_use.get(key, 0) == 0
            ]
            bound = list(self.bound.items())
        for checkpoint_id, (session_id, _) in bound:  # training sessions that ended
            if not self._running(session_id):
                self.unbind(checkpoint_id)
        for session_id in closing:
            self.bridge.stop_session(session_id)

    def _running(self, session_id: str) -> bool:
        row = self.bridge.worker.store.get(SessionRow, session_id)
        return row is not None and row.status == SES_RUNNING

    def _open(self, sampler: TinkerSampler) -> str:
        self.opened += 1
        resource_id = self.bridge.resource_for(sampler.base_model)
        spec: dict[str, Any]
        if sampler.checkpoint_id:
            spec = {"resume_from_checkpoint_id": sampler.checkpoint_id, "load_optimizer": False}
        else:
            spec = {"lora_config": {"rank": 1, "alpha": 1, "train_unembed": False}}
        spec["display_name"] = f"tinker sampler {sampler.id}"[:128]
        # the worker's own session, shared by every sampler of the checkpoint (each sampler's
        # user was checked against the checkpoint when the sampler was made: `new_sampler`)
        return self.bridge.open_session(resource_id, spec, "model_path", LOCAL, internal=True)

    def _evict(self) -> None:
        closing: list[str] = []
        with self.lock:
            for key in list(self.open):
                if len(self.open) <= MAX_SAMPLER_SESSIONS:
                    break
                if self.in_use.get(key, 0) == 0:
                    closing.append(self.open.pop(key))
        for session_id in closing:
            self.bridge.stop_session(session_id)


def _versions(output: dict[str, Any]) -> set[int]:
    """The weights versions a sample output's sequences came from."""
    return {
        int(segment["version"])
        for result in output.get("results", [])
        for segment in result.get("policy_segments", [])
    }


def sampler_owner(bridge: TinkerBridge, sampler: TinkerSampler) -> str | None:
    """Whose sampler it is: its recorded owner (its Tinker session's, or the user of an ad-hoc
    sample); for a record from before owners were recorded, its session's (an ad-hoc one's:
    nobody's, so an admin's alone)."""
    if sampler.owner is not None:
        return sampler.owner
    return session_owner(bridge, sampler.tinker_session) if sampler.tinker_session else None


def find_sampler(
    bridge: TinkerBridge, sampler_id: str, who: Principal, what: str, field: str
) -> TinkerSampler:
    """A sampler `who` may name, ad hoc or not; another user's is missing (the same 404)."""
    found = bridge.db.get(TinkerSampler, sampler_id)
    return owned(found, who, what, sampler_id, field, owner=lambda s: sampler_owner(bridge, s))


def still_readable(bridge: TinkerBridge, sampler: TinkerSampler, who: Principal) -> None:
    """A sampler of another user's checkpoint samples it while `who` may still read it: once
    its owner unpublishes it (docs/semantics.md §16.1), the sampler answers as the checkpoint
    does, the 404 of a missing one."""
    if not sampler.checkpoint_id or not sampler.model_path:
        return
    record = bridge.worker.checkpoints.get(sampler.checkpoint_id)
    if record is not None and bridge.worker.checkpoint_owner(record) != who.user:
        paths.loadable(bridge, sampler.model_path, "sampling_session_id", who)


def adhoc_id(who: Principal, target: str) -> str:
    """The id of an ad-hoc sampling target (`model_path` or `base_model` in the request): its
    user's own, so two users sampling the same target share no sampler, future or key."""
    return f"{ADHOC}{who.user}:{target}"


def samplers_of(request: Request) -> SamplerSessions:
    samplers: SamplerSessions = request.app.state.tinker_samplers
    return samplers


def new_sampler(
    bridge: TinkerBridge,
    sampler_id: str,
    tinker_session: str,
    base_model: str | None,
    model_path: str | None,
    who: Principal,
    keep: bool = True,
) -> TinkerSampler:
    """Record a sampling session (400/404 naming the field when its target does not exist,
    or is a checkpoint `who` may not see); `keep=False` only checks and builds it."""
    checkpoint_id = None
    if model_path:
        record = paths.loadable(bridge, model_path, "model_path", who)
        if record.lora_rank is None:
            raise bad_request(f"model_path: {model_path} is a full-weight checkpoint", "model_path")
        checkpoint_id, base = record.id, record.base_model
    else:
        base = base_model or ""
    sampler = TinkerSampler(
        id=sampler_id,
        tinker_session=tinker_session,
        base_model=bridge.entry(base, "base_model").name,
        created_at=time.time(),
        model_path=model_path,
        checkpoint_id=checkpoint_id,
        owner=session_owner(bridge, tinker_session) if tinker_session else who.user,
    )
    if keep:
        bridge.db.insert(sampler, replace=True)
    return sampler


@router.post("/create_sampling_session")
async def create_sampling_session(request: Request) -> dict[str, Any]:
    body: CreateSamplingSession = await parse(request, CreateSamplingSession)
    bridge = bridge_of(request)
    who = principal_of(request)
    get_session(bridge, body.session_id, who)
    sampler_id = f"{body.session_id}:sample:{body.sampling_session_seq_id}"
    await run_in_threadpool(
        new_sampler, bridge, sampler_id, body.session_id, body.base_model, body.model_path, who
    )
    return {"type": "create_sampling_session", "sampling_session_id": sampler_id}


@router.get("/samplers/{sampler_id}")
async def get_sampler(request: Request, sampler_id: str) -> dict[str, Any]:
    bridge = bridge_of(request)
    sampler = find_sampler(bridge, sampler_id, principal_of(request), "sampler", "sampler_id")
    return {
        "sampler_id": sampler.id,
        "base_model": sampler.base_model,
        "model_path": sampler.model_path,
    }


def _prepare_sample(bridge: TinkerBridge, base_model: str, body: dict[str, Any]) -> EngineCall:
    extra = (
        {convert.SAMPLE_EXTRA: body[convert.SAMPLE_EXTRA]} if convert.SAMPLE_EXTRA in body else None
    )
    try:
        vocab = vocab_size_of(bridge.worker, base_model)
        tokenizer = has_tokenizer(bridge.worker, base_model)
        entry = bridge.entry(base_model)
        return validated_call(OPERATIONS["sample"], body, entry, None, vocab, extra, tokenizer)
    except ApiError as exc:
        raise tinker_named("sample", exc) from None


@router.post("/asample")
async def asample(request: Request) -> dict[str, Any]:
    bridge = bridge_of(request)
    who = principal_of(request)
    req = await json_object(request, bridge.worker.config.max_body_bytes)
    sampler_id = req.get("sampling_session_id")
    if sampler_id is not None:
        field = "sampling_session_id"
        sampler = find_sampler(bridge, str(sampler_id), who, "sampling session", field)
        await run_in_threadpool(still_readable, bridge, sampler, who)
    elif req.get("model_path") or req.get("base_model"):
        path, base = req.get("model_path"), req.get("base_model")
        for name, value in (("model_path", path), ("base_model", base)):
            if value is not None and not isinstance(value, str):
                raise bad_request(f"{name}: must be a string", name)
        sampler = await run_in_threadpool(  # recorded once the request is accepted
            new_sampler, bridge, adhoc_id(who, str(path or base)), "", base, path, who, False
        )
    else:
        raise bad_request(
            "sampling_session_id: set it, or model_path / base_model", "sampling_session_id"
        )
    try:
        body = convert.sample_body(req, vocab_size_of(bridge.worker, sampler.base_model))
        asked = req.get("record_stability_info")
        record = asked is not None and flag(asked, "record_stability_info")
    except convert.TinkerInputError as exc:
        raise input_error(exc) from None
    if record and not sampler.tinker_session:
        raise bad_request(
            "record_stability_info: records belong to a Tinker session; sample through a "
            "sampling session (create_sampling_session) to record them",
            "record_stability_info",
        )
    call = await run_in_threadpool(_prepare_sample, bridge, sampler.base_model, body)
    key = await run_in_threadpool(request_key, request, sampler.id, "Sample", seq_id_of(req), body)
    if sampler_id is None:
        bridge.db.insert(sampler, replace=True)
    sessions = samplers_of(request)

    def work(request_id: str) -> dict[str, Any]:
        out = _sample(request_id)
        if record:  # what the generator returned, before the client can name it
            prompt = body["model_inputs"][0]["chunks"][0]["encoded_text"]["tokens"]
            records = stability.records_of_sample(sampler.tinker_session, request_id, prompt, out)
            bridge.stability.put(records)
        return convert.sample_output(out)

    def _sample(request_id: str) -> dict[str, Any]:
        bound = sessions.binding(sampler)
        if bound is not None:  # the training session publishes these weights (`bind`)
            session_id, version = bound
            out = bridge.run(session_id, "sample", call, request_id)
            if _versions(out) == {version}:
                return out
            assert sampler.checkpoint_id is not None
            sessions.unbind(sampler.checkpoint_id)  # published on since: the checkpoint's own
            request_id = f"{request_id}:checkpoint"
        held, session_id = sessions.acquire(sampler)
        try:
            return bridge.run(session_id, "sample", call, request_id)
        finally:
            sessions.release(held)

    request_id = bridge.start(sampler.id, "Sample", key, work, who)
    count = req.get("num_samples", 1)
    out = future_json(request_id)
    if isinstance(count, int):  # each becomes its `SampledSequence.sequence_id` in the SDK
        out["sample_sequence_ids"] = [f"{request_id}:{i}" for i in range(count)]
    return out
