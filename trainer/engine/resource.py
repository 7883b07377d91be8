"""A model resource: one loaded base model and the sessions that train on it.

A LoRA resource hosts many sessions at once; they share the frozen base weights and each has
its own adapter, optimizer and versions. A full-weight resource hosts one session at a time;
when it ends, the base weights are reloaded so the next session starts from the base model.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from trainer.checkpoint import base_weights, layout
from trainer.checkpoint.export import ENCRYPTED_EXPORT, is_encrypted
from trainer.checkpoint.layout import tied_source
from trainer.checkpoint.store import INFERENCE, CheckpointCorrupt, CheckpointStore
from trainer.compute import precision
from trainer.compute.lora_targets import head_attr
from trainer.compute.model import (
    COMPUTE_LOCK,
    default_device,
    is_adapter_dir,
    is_tied,
    local_dir,
    read_weights_as,
    with_context_limit,
)
from trainer.compute.moe_replay import routing_shape
from trainer.compute.placement import Placement, Plain
from trainer.compute.policy import LoraPolicy, Policy, SharedPeft, layout_like
from trainer.contract.errors import OperationError, invalid
from trainer.contract.generation import GeneratorOptions
from trainer.contract.optimizer import optimizer_kind
from trainer.contract.options import EngineOptions
from trainer.contract.specs import LoraConfig, ModelEntry, ResourceSpec, SessionSpec
from trainer.engine.batching.eligibility import model_has_dropout
from trainer.engine.batching.pass_scheduler import PassScheduler
from trainer.engine.batching.sample_batch import sample_counters
from trainer.engine.replica_check import GeneratorFallback
from trainer.engine.replicas import ReplicaPool, start_replicas
from trainer.engine.session import TrainingSession


class ModelResource:
    """`placement` (default: the whole model on `device`, one process) says where the model
    lives and how the ranks talk; everything else is the same for one rank or many."""

    def __init__(
        self,
        entry: ModelEntry,
        spec: ResourceSpec,
        store: CheckpointStore,
        device: str | None = None,
        options: EngineOptions | None = None,
        placement: Placement | None = None,
    ) -> None:
        self.entry = entry
        self.spec = spec
        self.store = store
        self.placement = placement or Plain(torch.device(device) if device else default_device())
        self.device = self.placement.device
        self.comm = self.placement.comm
        self.options = options or EngineOptions()
        self.lock = COMPUTE_LOCK  # process-wide: resources (and loads) take turns
        self.model, self.tokenizer = self.placement.load(self.entry)
        # the model's own context length bounds every sample, or the configured one if smaller
        self.entry = with_context_limit(entry, self.model.config.to_dict())
        if self.options.activation_checkpointing:
            # about -30-40% activation memory for about +25% time; off for tiny models
            self.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
            self.model.enable_input_require_grads()
        self.lora = spec.lora_enabled
        self.has_generator = spec.compute_config.num_generator_replicas > 0
        self.model_dropout = model_has_dropout(self.model.config)
        self.sessions: dict[str, TrainingSession] = {}
        self.peft = SharedPeft()  # the peft model of the LoRA sessions' adapters
        # forward(-backward) passes, shared by LoRA sessions' concurrent calls where they may
        self.scheduler = PassScheduler(self)
        self.sample_batcher: object | None = None  # made by a first batchable sample
        self._adapters = 0
        self._base_dirty = False
        self._base_tied = is_tied(self.model)
        self._base_dir: Path | None = None  # None: the catalogue entry's own weights
        # what a `merged_base` export's `source` is: the dtype of the files just loaded
        loaded_from = str(getattr(self.model.config, "name_or_path", "") or "")
        self._stored_dtype = precision.stored_dtype(Path(loaded_from)) if loaded_from else None
        if spec.base_weights_ref:  # a checkpoint's merged model instead (semantics §9)
            self._use_base_weights(spec.base_weights_ref)
        head = self.model.get_output_embeddings()
        self.vocab_size = int(head.weight.shape[0])
        self.hidden_size = int(head.weight.shape[1])  # the decoder's output: an embedding's
        # whether its samples record MoE routes and its training replays them (semantics §12)
        self.router_replay = routing_shape(self.model) is not None
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        self.eos_ids: set[int] = set(
            eos if isinstance(eos, list) else [eos] if eos is not None else []
        )
        # the vLLM replicas that serve this resource's samples (`[generator] backend`)
        self.replicas: ReplicaPool | None = None
        self.generator_fallback: str | None = None  # why vLLM does not serve it (in-process)
        generation = self.entry.generator or GeneratorOptions()
        if self.has_generator and generation.backend == "vllm":
            if self.comm.world_size > 1:
                raise ValueError("the vLLM generator backend runs in one process, not torchrun")
            try:
                self.replicas = start_replicas(
                    self.entry,
                    generation,
                    count=spec.compute_config.num_generator_replicas,
                    lora=self.lora,
                    tokenizer=self.tokenizer is not None,
                    device=self.device,
                    # checked against the loaded model when the replicas load the same weights
                    model=self.model if self._base_dir is None else None,
                )
            except GeneratorFallback as fallback:  # samples run in-process, exactly
                self.generator_fallback = str(fallback)

    def _draw_seed(self) -> int:
        """A fresh session seed when the spec gives none: rank 0 draws, every rank uses it
        (replicas must agree on the session's RNG)."""
        drawn = _random_seed() if self.comm.rank == 0 else None
        return int(self.comm.broadcast_json(drawn))

    # -- sessions --------------------------------------------------------------------------

    def create_session(self, session_id: str, spec: SessionSpec) -> TrainingSession:
        """Build a session, resuming from a checkpoint or a HF directory when asked."""
        with self.lock:
            if not self.lora and any(s.active for s in self.sessions.values()):
                raise OperationError(
                    "RESOURCE_EXHAUSTED", "a full-weight resource hosts one session at a time"
                )
            if spec.resume_from_checkpoint_id:
                return self._resume_checkpoint(session_id, spec)
            if spec.resume_from_hf_checkpoint:
                return self._resume_hf(session_id, spec)
            session = self._new_session(session_id, spec, spec.lora_config or LoraConfig())
            self.sessions[session_id] = session
            return session

    def _new_session(
        self,
        session_id: str,
        spec: SessionSpec,
        lora_config: LoraConfig,
        seed: int | None = None,
        untie_head: bool = False,
    ) -> TrainingSession:
        policy: Policy
        if seed is None:  # a seeded LoRA session is reproducible end to end, dropout included
            seed = lora_config.seed if self.lora and lora_config.seed is not None else None
        rng_seed = seed if seed is not None else self._draw_seed()
        if self.lora:
            self._check_rank(lora_config, "lora_config.rank", "")
            lora_seed = lora_config.seed if lora_config.seed is not None else rng_seed
            self._adapters += 1
            policy = LoraPolicy(
                self.model,
                self.peft,
                f"s{self._adapters}",
                lora_config,
                lora_seed,
                with_generator=self.has_generator,
            )
        else:
            if self._base_dirty:
                self._reload_base()
            self._base_dirty = True
            if untie_head and is_tied(self.model):
                _untie_head(self.model)
            policy = self.placement.full_policy(self.model, self.has_generator)
        self._adapters_to_device()
        return TrainingSession(
            resource=self,
            id=session_id,
            spec=spec,
            policy=policy,
            rng_seed=rng_seed,
            options=self.options,
        )

    def _adapters_to_device(self) -> None:
        """peft puts a new adapter where the base weight lives: the CPU for a shard under
        `cpu_offload`. Adapters are not FSDP's to move, so they join the compute device here."""
        with torch.no_grad():
            for param in self.model.parameters():
                if not isinstance(param, DTensor) and param.device != self.device:
                    param.data = param.data.to(self.device)

    def _check_rank(self, config: LoraConfig, field: str, source: str) -> None:
        """The effective LoRA config (a resumed checkpoint's own) within the model's limit."""
        if self.lora and config.rank > self.entry.max_lora_rank:
            raise invalid(
                field,
                f"{source}LoRA rank {config.rank} exceeds max_lora_rank "
                f"{self.entry.max_lora_rank} of {self.entry.name}",
            )

    def export_dtype(self, name: str) -> torch.dtype:
        """The dtype of a merged export at precision `name`: `source` (the base model's stored
        dtype, else the trainer's) or `bf16` (docs/semantics.md §23)."""
        if name == "source":
            return self._stored_dtype or self.model.dtype
        return precision.EXPORTED[name]

    def _use_base_weights(self, ref: str) -> None:
        """Train from inference checkpoint `ref`'s merged model: checked against the loaded
        architecture, its head untied when the export's is, then copied in."""
        if self.lora:
            raise base_weights.RefError("a LoRA resource trains on its base model's own weights")
        config = self.model.config.to_dict()
        self._base_dir = base_weights.merged_dir(self.store, ref, self.entry.name, config)
        if self._base_tied and not base_weights.is_tied(base_weights.read_config(self._base_dir)):
            if self.comm.world_size > 1:  # FSDP2 holds the tied parameter: no new one now
                raise base_weights.RefError(
                    f"checkpoint {ref} has its own output head and {self.entry.name} ties it "
                    "to the embeddings: not supported with more than one rank"
                )
            _untie_head(self.model)
            self._base_tied = False
        self._reload_base()

    def _reload_base(self) -> None:
        if self._base_tied and not is_tied(self.model):
            _retie_head(self.model)
        source = self._base_dir or local_dir(self.entry.location, self.entry.revision)
        weights = read_weights_as(self.model, source, self.entry.trust_remote_code)
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, param in params.items():
                value = weights.get(name, weights.get(tied_source(name)))
                if value is None or value.shape != param.shape:
                    raise ValueError(f"{source}: no weight {name} of shape {tuple(param.shape)}")
                param.copy_(layout_like(param, value, cast=False))

    def _resume_checkpoint(self, session_id: str, spec: SessionSpec) -> TrainingSession:
        field = "resume_from_checkpoint_id"
        checkpoint_id = spec.resume_from_checkpoint_id or ""
        try:
            record, manifest = self.store.open(checkpoint_id)
        except KeyError:
            raise invalid(field, f"no checkpoint {checkpoint_id!r}") from None
        except CheckpointCorrupt as exc:
            raise invalid(field, str(exc)) from None
        if is_encrypted(manifest):
            raise invalid(field, f"checkpoint {checkpoint_id} {ENCRYPTED_EXPORT}")
        state = layout.read_state(record.path)
        if state["base_model"] != self.entry.name:
            raise invalid(
                field,
                f"checkpoint was trained on base model {state['base_model']!r}, "
                f"this resource serves {self.entry.name!r}",
            )
        lora = state["kind"] == "lora"
        # a LoRA sampler checkpoint resumes into full weights too: from its merged model, the
        # files a promoted `merged_base` save serves (docs/semantics.md §16)
        if lora != self.lora and not (lora and record.type == INFERENCE):
            kind = "LoRA" if lora else "full-weight"
            raise invalid(
                field, f"a {kind} checkpoint needs a resource with lora_enabled={not self.lora}"
            )
        if record.type == INFERENCE:
            if spec.load_optimizer:
                raise invalid("load_optimizer", "an inference checkpoint has no optimizer state")
            source = layout.inference_weights(record.path, self.lora)
            if lora and not source.exists():  # an adapter export: the adapter, merged here
                source = layout.inference_weights(record.path, True)
            return self._from_directory(session_id, spec, source, field)
        lora_config = layout.lora_config_of(state)
        self._check_rank(lora_config, field, f"checkpoint {checkpoint_id}: its ")
        load_optimizer = spec.load_optimizer is not False
        saved, ours = (
            optimizer_kind(config.get("optimizer_config"))
            for config in (state.get("resource_spec") or {}, self.spec.model_dump())
        )
        if load_optimizer and saved != ours:
            raise invalid(
                "load_optimizer",
                f"checkpoint {checkpoint_id} holds {saved} optimizer state and this resource "
                f"uses {ours}: resume with load_optimizer false",
            )
        session = self._new_session(
            session_id, spec, lora_config, seed=state["rng_seed"] if load_optimizer else None
        )
        return self._install(
            session,
            field,
            lambda: layout.read_training(session, record.path, state, load_optimizer, field),
        )

    def _resume_hf(self, session_id: str, spec: SessionSpec) -> TrainingSession:
        field = "resume_from_hf_checkpoint"
        location = spec.resume_from_hf_checkpoint or ""
        try:
            source = local_dir(location)
        except Exception as exc:  # hub errors come in many types; all mean "cannot read it"
            raise invalid(field, f"cannot read {location!r}: {exc}") from None
        return self._from_directory(session_id, spec, source, field)

    def _from_directory(
        self, session_id: str, spec: SessionSpec, source: Path, field: str
    ) -> TrainingSession:
        """Weights only (fresh optimizer, step 0) from a PEFT adapter or a full model dir."""
        adapter = is_adapter_dir(source)
        if self.lora and not adapter:
            raise invalid(field, "a LoRA resource resumes from a PEFT adapter directory")
        try:
            lora_config, weights = layout.read_directory(
                source, adapter, self.model, self.entry.trust_remote_code
            )
        except KeyError as exc:
            raise invalid(field, f"{source.name}: its files lack {exc}") from None
        except (OSError, ValueError) as exc:
            raise invalid(field, str(exc)) from None
        self._check_rank(lora_config, field, f"{source.name}: the adapter's ")
        if self.lora:
            untie = False
        else:  # an adapter that trains the head, or a model whose head is its own
            untie = lora_config.train_unembed if adapter else self._own_head(weights)
        if untie and self._base_tied and self.comm.world_size > 1:  # FSDP2 holds the tied one
            raise invalid(
                field,
                f"{source.name}: its output head is its own and {self.entry.name} ties it to "
                "the embeddings: not supported with more than one rank",
            )
        session = self._new_session(session_id, spec, lora_config, untie_head=untie)
        return self._install(
            session,
            field,
            lambda: layout.load_directory_weights(
                session.policy, weights, adapter, lora_config, field
            ),
        )

    def _own_head(self, weights: dict[str, torch.Tensor]) -> bool:
        """Whether a full model's `weights` hold an output head of their own where this
        resource ties it to the embeddings: one they store, unlike their embedding."""
        head = weights.get(f"{head_attr(self.model)}.weight")
        embedding = weights.get(self._embedding_name())
        return (
            self._base_tied
            and head is not None
            and (embedding is None or not torch.equal(head, embedding))
        )

    def _embedding_name(self) -> str:
        """The input embedding's parameter name (a composite's is inside its language model)."""
        weight = self.model.get_input_embeddings().weight
        return next(n for n, p in self.model.named_parameters() if p is weight)

    def _install(
        self, session: TrainingSession, field: str, load: Callable[[], None]
    ) -> TrainingSession:
        """Load a new session's state, publish it, and list it; a refusal (`ValueError`)
        closes it and names `field`."""
        try:
            load()
            session.generator.publish()
        except ValueError as exc:
            session.close()
            raise invalid(field, str(exc)) from None
        self.sessions[session.id] = session
        return session

    def close_session(self, session_id: str) -> None:
        session = self.sessions.pop(session_id, None)
        if session is not None and session.active:
            session.close()

    def counters(self) -> dict[str, int]:
        """The batching counters of this resource: passes and sample batches."""
        return {**self.scheduler.counters(), **sample_counters(self)}

    def generator_status(self) -> dict[str, Any]:
        """What serves samples: the backend, and each replica's state when there are some."""
        if not self.has_generator:
            return {"backend": None}
        if self.replicas is None:
            reason = {"fallback": self.generator_fallback} if self.generator_fallback else {}
            return {"backend": "hf", **reason}
        return self.replicas.describe()

    def close(self) -> None:
        with self.lock:
            for session_id in list(self.sessions):
                self.close_session(session_id)
            if self.replicas is not None:
                self.replicas.close()
            self.model = None  # type: ignore[assignment]
            self.peft.close()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def _random_seed() -> int:
    return int.from_bytes(os.urandom(7), "little")


def _set_tied(model: Any, tied: bool) -> None:
    model.config.tie_word_embeddings = tied
    text_config = getattr(model.config, "text_config", None)
    if text_config is not None:
        text_config.tie_word_embeddings = tied


def _untie_head(model: Any) -> None:
    """Give the output head its own copy of the embedding, so training it (or merging a head
    LoRA into it) leaves the input embeddings alone."""
    head = model.get_output_embeddings()
    head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    _set_tied(model, False)


def _retie_head(model: Any) -> None:
    model.get_output_embeddings().weight = model.get_input_embeddings().weight
    _set_tied(model, True)
