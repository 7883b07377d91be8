"""The operation table: each session operation is declared once, here.

An `Operation` names its kind (the URL segment), its request body model, the engine method it
calls, how the validated body becomes that method's keyword arguments, how the call's result
becomes the operation's wire JSON, and an optional check against the model's limits. The rest
is derived from `OPERATIONS`:
- `trainer.api.rl.routes_ops`: a POST and a GET route per entry (so the OpenAPI schema names each
  kind's body), the body validated and checked, the call queued on the session;
- `trainer.distributed.spmd`: rank 0's `DistributedSession` forwards each entry's `method` to
  every rank as JSON, and every rank dispatches it by that name.
Adding an operation is one entry here plus one method on `trainer.engine.session.TrainingSession`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from trainer.contract.losses import LOSS_SPECS
from trainer.contract.specs import ModelEntry, chunk_datums
from trainer.engine.session import TrainingSession
from trainer.serving.catalogue import OP_COMPLETED, ResourceRow
from trainer.serving.checkpoint_errors import save_checkpoint
from trainer.serving.errors import bad_request, from_pydantic
from trainer.serving.requests import (
    CustomForwardBackwardBody,
    EmbeddingForwardBackwardBody,
    EmptyBody,
    ForwardBackwardBody,
    OptimStepBody,
    SampleBody,
    WeightsSyncBody,
    check_custom,
    check_embedding,
    check_forward_backward,
    check_optimizer_params,
    check_sample,
)
from trainer.serving.worker import CountedCall, EngineCall, Worker


def _as_is(call: Callable[[], Any]) -> dict[str, Any]:
    result: dict[str, Any] = call()
    return result


def _or_empty(call: Callable[[], Any]) -> dict[str, Any]:
    return call() or {}


def _no_args(_: Any) -> dict[str, Any]:
    return {}


def _no_tokens(_: Any) -> int:
    return 0


def _sample_tokens(samples: list[Any]) -> int:
    return sum(sum(s.model_input.chunk_lengths()) for s in samples)


def _fb_tokens(body: Any) -> int:
    """A forward-backward trains on its samples' input tokens (none when forward-only)."""
    return 0 if body.forward_only else _sample_tokens(body.samples)


@dataclass(frozen=True)
class Operation:
    kind: str  # the URL segment: `.../operations/<kind>`
    body: type[BaseModel]  # the request body, validated once at the edge
    method: str  # the engine session's method (and the SPMD command's `op`)
    args: Callable[[Any], dict[str, Any]] = _no_args  # validated body -> keyword arguments
    wire: Callable[[Callable[[], Any]], dict[str, Any]] = _as_is  # runs the call, shapes it
    # limits of the model and, where known, its vocabulary, as a 400
    check: Callable[[Any, ModelEntry, int | None], None] | None = None
    # the resource's optimizer_config, as a 400 (params of the other optimizer)
    check_optimizer: Callable[[Any, dict[str, Any]], None] | None = None
    # validated body -> the tokens it trains on (`trainer_tokens_trained_total`)
    trained_tokens: Callable[[Any], int] = _no_tokens
    rl_face: bool = True  # the RL session API has a route for it (else: another face's only)

    def call(self, body: BaseModel, extra: dict[str, Any] | None = None) -> CountedCall:
        """What the worker queues: the engine session in, the operation's wire JSON out.
        `extra`: engine arguments a face adds that the body does not carry (the Tinker face's
        adapter export, its `prompt_logprobs_last_n`; a sample's `watch`)."""
        args = {**self.args(body), **(extra or {})}
        return CountedCall(
            lambda session: self.wire(lambda: getattr(session, self.method)(**args)),
            self.trained_tokens(body),
        )


OPERATIONS: dict[str, Operation] = {
    op.kind: op
    for op in (
        Operation(
            "forward-backward",
            ForwardBackwardBody,
            "forward_backward",
            lambda b: {
                "loss": b.loss,
                "samples": b.samples,
                "forward_only": b.forward_only,
                "return_loss_fn_outputs": b.return_loss_fn_outputs,
                "logprobs_unmasked": b.logprobs_unmasked,
            },
            check=check_forward_backward,
            trained_tokens=_fb_tokens,
        ),
        Operation(
            "custom-forward-backward",
            CustomForwardBackwardBody,
            "custom_forward_backward",
            lambda b: {"samples": b.samples, "gradients": b.gradients},
            wire=_or_empty,
            check=check_custom,
            trained_tokens=lambda b: _sample_tokens(b.samples),
        ),
        Operation(
            "embedding-forward-backward",
            EmbeddingForwardBackwardBody,
            "embedding_forward_backward",
            lambda b: {
                "samples": b.samples,
                "objective": b.objective,
                "forward_only": b.forward_only,
                "gradients": b.gradients,
            },
            check=check_embedding,
            trained_tokens=_fb_tokens,
            rl_face=False,
        ),
        Operation(
            "optim-step",
            OptimStepBody,
            "optim_step",
            lambda b: {"adam": b.adam_params, "muon": b.muon_params},
            check_optimizer=check_optimizer_params,
        ),
        Operation(
            "weights-sync",
            WeightsSyncBody,
            "weights_sync",
            lambda b: {"sync_type": b.weight_sync_type},
        ),
        Operation(
            "sample",
            SampleBody,
            "sample",
            lambda b: {
                "model_inputs": b.model_inputs,
                "num_samples": b.num_samples,
                "sampling_params": b.sampling_params,
                "prompt_logprobs": b.prompt_logprobs,
                "topk_prompt_logprobs": b.topk_prompt_logprobs,
                "return_routed_experts": b.return_routed_experts,
                "sampling_logprobs": b.sampling_logprobs,
                "target_prompt_ids": b.target_prompt_ids,
                "prompt_alt_tokens_k": b.prompt_alt_tokens_k,
            },
            check=check_sample,
        ),
        Operation(
            "training-checkpoint", EmptyBody, "save_training_checkpoint", wire=save_checkpoint
        ),
        Operation(
            "inference-checkpoint", EmptyBody, "save_inference_checkpoint", wire=save_checkpoint
        ),
    )
}

# the engine methods the table calls, by name: exactly the session's operations
METHODS: dict[str, Operation] = {op.method: op for op in OPERATIONS.values()}
assert set(METHODS) == set(TrainingSession.OPERATIONS), "the table must cover the engine's ops"


def vocab_size_of(worker: Worker, base_model: str) -> int | None:
    """The vocabulary of `base_model` where a loaded resource serves it; None while none has
    loaded (the engine then checks the ids)."""
    return _size_of(worker, base_model, "vocab_size")


def hidden_size_of(worker: Worker, base_model: str) -> int | None:
    """The width of `base_model`'s last hidden state (an embedding's length), where a loaded
    resource serves it; None while none has loaded (the engine then checks it)."""
    return _size_of(worker, base_model, "hidden_size")


def _size_of(worker: Worker, base_model: str, name: str) -> int | None:
    with worker.resources.lock:
        lives = list(worker.resources.live.values())
    for live in lives:
        size = getattr(live.engine, name, None)
        if live.entry.name == base_model and isinstance(size, int):
            return size
    return None


def router_replay_of(worker: Worker, base_model: str) -> bool | None:
    """Whether a loaded resource serving `base_model` records and replays MoE routes
    (docs/semantics.md §12); None while none has loaded."""
    with worker.resources.lock:
        lives = list(worker.resources.live.values())
    for live in lives:
        replay = getattr(live.engine, "router_replay", None)
        if live.entry.name == base_model and isinstance(replay, bool):
            return replay
    return None


_ABSENT = object()


def _tokenizer(worker: Worker, base_model: str) -> Any:
    """The tokenizer of the model a loaded resource serves for `base_model` (None: it has
    none); `_ABSENT` while none has loaded."""
    with worker.resources.lock:
        lives = list(worker.resources.live.values())
    for live in lives:
        if live.entry.name == base_model and live.engine is not None:
            return getattr(live.engine, "tokenizer", _ABSENT)
    return _ABSENT


def has_tokenizer(worker: Worker, base_model: str) -> bool | None:
    """Whether the model a loaded resource serves for `base_model` has a tokenizer; None while
    none has loaded (the engine then checks what needs one)."""
    tokenizer = _tokenizer(worker, base_model)
    return None if tokenizer is _ABSENT else tokenizer is not None


def tokenizer_of(worker: Worker, base_model: str) -> Any:
    """The tokenizer itself (None: the model has none, or none has loaded yet)."""
    tokenizer = _tokenizer(worker, base_model)
    return None if tokenizer is _ABSENT else tokenizer


def _check_stop_strings(body: Any, entry: ModelEntry, tokenizer: bool | None) -> None:
    """Stop strings are matched on decoded text: a model without a tokenizer refuses them at
    the door (a 400 naming the field), not in the queued operation."""
    params = getattr(body, "sampling_params", None)
    if tokenizer is False and params is not None and params.stop:
        raise bad_request(
            f"sampling_params.stop: stop strings need a tokenizer and {entry.name} has none; "
            "stop on token ids instead",
            "sampling_params.stop",
        )


def validated_call(
    spec: Operation,
    body: dict[str, Any],
    entry: ModelEntry,
    optimizer_config: dict[str, Any] | None = None,
    vocab_size: int | None = None,
    extra: dict[str, Any] | None = None,
    tokenizer: bool | None = None,
) -> EngineCall:
    """A body checked against its model (and vocabulary and tokenizer, where known) and type,
    turned into the call the worker queues (with `extra` keyword arguments: `Operation.call`)."""
    try:
        parsed = spec.body.model_validate(body)
    except ValidationError as exc:
        raise from_pydantic(exc) from None
    _check_stop_strings(parsed, entry, tokenizer)
    if spec.check is not None:
        spec.check(parsed, entry, vocab_size)
    if spec.check_optimizer is not None:
        spec.check_optimizer(parsed, optimizer_config or {"adam": {}})
    return spec.call(parsed, extra)


def _rl_face_loss(loss: Any) -> None:
    """A loss whose inputs only the Tinker face builds (`LossSpec.rl_face`) is a 400 on the RL
    face."""
    name = loss.get("type") if isinstance(loss, dict) else None
    if not isinstance(name, str):
        return  # the body's validation names what is wrong
    key = name if name.startswith("LOSS_TYPE_") else f"LOSS_TYPE_{name.upper()}"
    spec = LOSS_SPECS.get(key)
    if spec is not None and not spec.rl_face:
        raise bad_request(
            f"loss.type: {key} is served on the Tinker face only (its sampler logprobs come "
            "from the records that face keeps; docs/semantics.md §13)",
            "loss.type",
        )


def prepare_call(
    worker: Worker,
    session_id: str,
    spec: Operation,
    body: dict[str, Any],
    extra: dict[str, Any] | None = None,
    rl_face: bool = True,
) -> EngineCall:
    """Merge an uploaded payload, validate, check limits (blocking: runs in a thread).
    `rl_face`: the body came from the RL session API (not built by the Tinker face)."""
    payload_id = body.get("payload_id")
    if payload_id is not None:
        if not isinstance(payload_id, str):
            raise bad_request("payload_id: must be a string", "payload_id")
        full = {k: v for k, v in body.items() if k != "payload_id"}
        full.update(worker.payloads.read_json(session_id, payload_id))
        body = full
    if rl_face and spec.kind == "forward-backward":
        _rl_face_loss(body.get("loss"))
    resource = worker.store.get(ResourceRow, worker.session(session_id).resource_id)
    entry = worker.config.model(resource.spec["base_model"]) if resource is not None else None
    if entry is None:
        raise bad_request("the session's base model is no longer served", "session_id")
    config = resource.spec.get("optimizer_config") if resource is not None else None
    # the Tinker face's chunks
    if not rl_face and spec.kind in ("forward-backward", "embedding-forward-backward"):
        entry = entry.model_copy(update={"max_batch_size": chunk_datums(entry.max_batch_size)})
    vocab, tokenizer = vocab_size_of(worker, entry.name), has_tokenizer(worker, entry.name)
    return validated_call(spec, body, entry, config, vocab, extra, tokenizer)


def run_to_end(
    worker: Worker, session_id: str, kind: str, key: str, body_hash: str, call: EngineCall
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """Queue `call` on the session now and wait for it to end (blocking): its error (None when
    it completed) and its whole output, an offloaded payload read back."""
    row = worker.submit(session_id, kind, key, body_hash, call)
    done = worker.oplog.futures.get(row.id)
    if done is not None:
        done.result()
    row = worker.find_operation(session_id, kind, row.id)
    if row.status != OP_COMPLETED:
        return row.error or {}, {}
    output = dict(row.output or {})
    payload_id = output.pop("payload_id", None)
    if payload_id is not None:
        output.update(worker.payloads.read_json(session_id, payload_id))
    return None, output
