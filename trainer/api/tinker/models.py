"""What a Tinker model is made of: its resource, its engine session's spec and its rules.

Three kinds (`ModelPlan.kind`), chosen by `create_model`'s body and the gateway's `Binding`:
- `lora`: a LoRA session (rank, `alpha` and seed from `lora_config`) on the face's shared
  LoRA resource of the base model, or on a bound job's resource (rank up to the job's);
- `full`: `lora_config.rank == 0`, full weights: unbound, a new full-weight resource of the
  caller's own (it counts against their `max_resources` quota; one session per resource);
  bound, the job's full-weight resource;
- `base`: `base_only`, a frozen reference that computes exactly the base model: a rank-1 LoRA
  session whose B matrices are zero (as `sampling.py` samples the base model), forward only.
A model of a `forward_only` job is frozen too: `check_trainable` refuses what would change
or save its weights, as a 400 naming `model_id`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainer.api.tinker.binding import Binding
from trainer.api.tinker.bridge import RequestFailed, TinkerBridge
from trainer.api.tinker.records import TinkerModel
from trainer.api.tinker.requests import CreateModel
from trainer.contract.routing import FORMAT
from trainer.contract.specs import ModelEntry, ResourceSpec
from trainer.serving.catalogue import RES_READY
from trainer.serving.errors import ApiError, bad_request
from trainer.serving.operations import router_replay_of
from trainer.serving.tenants import Principal

LORA_ALPHA = 32  # Tinker's LoRA scale convention (alpha 32 whatever the rank); docs/decisions.md
DEFAULT_RANK = 32
BASE_LORA = {"rank": 1, "alpha": 1, "train_unembed": False}  # B = 0: the base model exactly


@dataclass(frozen=True)
class ModelPlan:
    kind: str  # "lora" | "full" | "base"
    base_model: str
    lora_config: dict[str, Any] | None  # the engine session's; None: full weights
    frozen: bool
    binding: Binding | None

    @property
    def rank(self) -> int:
        """The model's LoRA rank as `get_info` reports it (0: full weights or frozen base)."""
        return 0 if self.kind != "lora" or self.lora_config is None else self.lora_config["rank"]


def capabilities(bridge: TinkerBridge, base_model: str) -> dict[str, Any]:
    """What `create_model` answers besides the model id, for the Fireworks SDK
    (`_CreateModelResponse`): whether the model replays R3 routes (an MoE model whose routers
    the engine records and forces, docs/semantics.md §12) and the one routing-matrix format
    it reads. Tinker's own SDK ignores them."""
    replay = router_replay_of(bridge.worker, base_model)
    if replay is None:
        return {}
    return {"supports_router_replay": replay, "routing_matrix_format": FORMAT}


def plan(body: CreateModel, entry: ModelEntry, binding: Binding | None) -> ModelPlan:
    """The model a `create_model` body asks for, checked against the model's limits and the
    job's rules (a 400 naming the field)."""
    if binding is not None and entry.name != binding.base_model:
        raise bad_request(
            f"base_model: this job trains {binding.base_model!r}, not {body.base_model!r}",
            "base_model",
        )
    frozen = binding is not None and binding.forward_only
    if body.base_only:
        return ModelPlan("base", entry.name, dict(BASE_LORA), True, binding)
    lora = body.lora_config
    rank = lora.rank if lora is not None else min(DEFAULT_RANK, entry.max_lora_rank)
    if binding is not None and lora is None:  # the job's own kind of training
        rank = min(binding.lora_rank, entry.max_lora_rank)
    if rank == 0:
        if binding is not None and binding.lora_rank != 0:
            raise bad_request(
                f"lora_config.rank: 0 (full weights) on a LoRA job of rank {binding.lora_rank}",
                "lora_config.rank",
            )
        return ModelPlan("full", entry.name, None, frozen, binding)
    limit, of = entry.max_lora_rank, f"max_lora_rank {entry.max_lora_rank} of {entry.name}"
    if binding is not None:
        if binding.lora_rank == 0:
            raise bad_request(
                f"lora_config.rank: {rank} on a full-weight job (send rank 0)", "lora_config.rank"
            )
        limit, of = min(limit, binding.lora_rank), f"the job's lora_rank {binding.lora_rank}"
    if rank > limit:
        raise ApiError(
            400,
            f"lora_config.rank: {rank} exceeds {of}",
            param="lora_config.rank",
            code="invalid_input",
        )
    config: dict[str, Any] = {
        "rank": rank,
        "alpha": lora.alpha if lora is not None and lora.alpha is not None else LORA_ALPHA,
        "seed": lora.seed if lora is not None else None,
        "train_unembed": lora.train_unembed if lora is not None else True,
    }
    if lora is not None and lora.init_method is not None:
        config["init_method"] = lora.init_method
    return ModelPlan("lora", entry.name, config, frozen, binding)


def resource_of(bridge: TinkerBridge, plan: ModelPlan, who: Principal) -> str:
    """The READY resource the model's session opens on (blocking while one loads)."""
    binding = plan.binding
    if binding is not None and not (plan.kind == "base" and binding.lora_rank == 0):
        return _ready(bridge, binding.resource_id, plan.base_model)
    if plan.kind == "full":
        spec = ResourceSpec(base_model=plan.base_model, lora_enabled=False, inactive_timeout=86400)
        return _ready(bridge, bridge.worker.create_resource(spec, who=who).id, plan.base_model)
    # LoRA and frozen base models share the face's LoRA resource (a full-weight job's base
    # reference too: its own resource hosts one session)
    return bridge.resource_for(plan.base_model)


def take_over(bridge: TinkerBridge, plan: ModelPlan, resource_id: str) -> None:
    """A full-weight job hosts one model: a new model on it ends the job's earlier one (the
    same account's, by the binding: a client that exited without closing it, a reference job
    kept for a resumed run); the earlier model then answers "no longer loaded"
    (docs/semantics.md §23)."""
    if plan.binding is None or plan.kind != "full":
        return
    with bridge.worker.lock:
        held = [s.id for s in bridge.worker.sessions.values() if s.resource_id == resource_id]
    for session_id in held:
        bridge.stop_session(session_id)


def _ready(bridge: TinkerBridge, resource_id: str, base_model: str) -> str:
    loaded = bridge.worker.resource_loaded(resource_id)
    if loaded is not None:
        loaded.result()
    row = bridge.worker.resource(resource_id)
    if row.status != RES_READY:
        error = (row.error or {}).get("message", row.status)
        raise RequestFailed(f"loading base model {base_model!r} failed: {error}", "server")
    return resource_id


def session_spec(plan: ModelPlan, display: str) -> dict[str, Any]:
    spec: dict[str, Any] = {"display_name": display[:128]}
    if plan.lora_config is not None:
        spec["lora_config"] = plan.lora_config
    return spec


def check_trainable(model: TinkerModel, op: str) -> None:
    """A frozen model (a base reference, or on a forward-only job) runs forwards only."""
    if model.frozen:
        raise bad_request(
            f"model_id: model {model.id} is a frozen reference (base_only, or a forward-only "
            f"job): it serves forward only, not {op}",
            "model_id",
        )


def is_full(model: TinkerModel) -> bool:
    return model.lora_rank == 0 and not model.frozen
