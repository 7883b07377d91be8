"""A model resource: one loaded base model and the sessions that train on it.

A LoRA resource hosts many sessions at once; they share the frozen base weights and each has
its own adapter, optimizer and versions. A full-weight resource hosts one session at a time;
when it ends, the base weights are reloaded so the next session starts from the base model.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from trainer.checkpoints import INFERENCE, CheckpointCorrupt, CheckpointStore
from trainer.errors import OperationError, invalid
from trainer.model import (
    COMPUTE_LOCK,
    default_device,
    is_adapter_dir,
    is_tied,
    load_base_model,
    local_dir,
    read_model_weights,
    with_context_limit,
)
from trainer.policy import FullPolicy, LoraPolicy, Policy, layout_like
from trainer.session import EngineOptions, TrainingSession, Versions
from trainer.specs import LoraConfig, ModelEntry, ResourceSpec, SessionSpec

SHARDED_DIR = "sharded"  # a multi-rank training checkpoint's tensors (weights + optimizer)


class ModelResource:
    session_type: type[TrainingSession] = TrainingSession

    def __init__(
        self,
        entry: ModelEntry,
        spec: ResourceSpec,
        store: CheckpointStore,
        device: str | None = None,
        options: EngineOptions | None = None,
    ) -> None:
        self.entry = entry
        self.spec = spec
        self.store = store
        self.device = torch.device(device) if device else default_device()
        self.options = options or EngineOptions()
        self.lock = COMPUTE_LOCK  # process-wide: resources (and loads) take turns
        self.model, self.tokenizer = self._load_model()
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
        self.sessions: dict[str, TrainingSession] = {}
        self._peft: dict[str, Any] = {"model": None}
        self._adapters = 0
        self._base_dirty = False
        self._base_tied = is_tied(self.model)
        head = self.model.get_output_embeddings()
        self.vocab_size = int(head.weight.shape[0])
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        self.eos_ids: set[int] = set(
            eos if isinstance(eos, list) else [eos] if eos is not None else []
        )

    def _load_model(self) -> tuple[Any, Any]:
        return load_base_model(self.entry, self.device)

    def _draw_seed(self) -> int:
        """A fresh session seed when the spec gives none."""
        return _random_seed()

    def _full_policy(self) -> Policy:
        return FullPolicy(self.model, with_generator=self.has_generator)

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
                self._peft,
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
            policy = self._full_policy()
        return self.session_type(
            resource=self,
            id=session_id,
            spec=spec,
            policy=policy,
            rng_seed=rng_seed,
            options=self.options,
        )

    def _check_rank(self, config: LoraConfig, field: str, source: str) -> None:
        """The effective LoRA config (a resumed checkpoint's own) within the model's limit."""
        if self.lora and config.rank > self.entry.max_lora_rank:
            raise invalid(
                field,
                f"{source}LoRA rank {config.rank} exceeds max_lora_rank "
                f"{self.entry.max_lora_rank} of {self.entry.name}",
            )

    def _reload_base(self) -> None:
        if self._base_tied and not is_tied(self.model):
            _retie_head(self.model)
        weights = read_model_weights(local_dir(self.entry.location, self.entry.revision))
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, param in params.items():
                value = weights[name] if name in weights else weights[_tied_source(name)]
                param.copy_(layout_like(param, value, cast=False))

    def _resume_checkpoint(self, session_id: str, spec: SessionSpec) -> TrainingSession:
        field = "resume_from_checkpoint_id"
        checkpoint_id = spec.resume_from_checkpoint_id or ""
        try:
            record, _ = self.store.open(checkpoint_id)
        except KeyError:
            raise invalid(field, f"no checkpoint {checkpoint_id!r}") from None
        except CheckpointCorrupt as exc:
            raise invalid(field, str(exc)) from None
        state = json.loads((record.path / "state.json").read_text())
        if state["base_model"] != self.entry.name:
            raise invalid(
                field,
                f"checkpoint was trained on base model {state['base_model']!r}, "
                f"this resource serves {self.entry.name!r}",
            )
        if (state["kind"] == "lora") != self.lora:
            kind = "LoRA" if state["kind"] == "lora" else "full-weight"
            raise invalid(
                field, f"a {kind} checkpoint needs a resource with lora_enabled={not self.lora}"
            )
        if record.type == INFERENCE:
            if spec.load_optimizer:
                raise invalid("load_optimizer", "an inference checkpoint has no optimizer state")
            source = record.path / ("adapter" if self.lora else "merged")
            return self._from_directory(session_id, spec, source, field)
        lora_config = LoraConfig(**state["lora_config"]) if state["lora_config"] else LoraConfig()
        self._check_rank(lora_config, field, f"checkpoint {checkpoint_id}: its ")
        load_optimizer = spec.load_optimizer is not False
        session = self._new_session(
            session_id, spec, lora_config, seed=state["rng_seed"] if load_optimizer else None
        )
        try:
            self._restore_tensors(session, record.path, load_optimizer, field)
            if load_optimizer:
                session.restore_rng(load_file(str(record.path / "rng.safetensors")))
                session.step = state["step"]
                session.versions = Versions(
                    trainer_step=state["trainer_step"],
                    target_weights_version=state["trainer_step"],
                    applied_weights_version=state["trainer_step"],
                )
            session.policy.publish()
        except ValueError as exc:
            session.close()
            raise invalid(field, str(exc)) from None
        self.sessions[session_id] = session
        return session

    def _restore_tensors(
        self, session: TrainingSession, path: Path, load_optimizer: bool, field: str
    ) -> None:
        """Weights (and the optimizer state) of a training checkpoint into a new session."""
        if (path / "weights.safetensors").exists():
            weights = load_file(str(path / "weights.safetensors"))
            optimizer = load_file(str(path / "optimizer.safetensors")) if load_optimizer else {}
        else:  # written by several ranks: see trainer/distributed.py
            tensors = read_sharded(path / SHARDED_DIR)
            weights = {k: v for k, v in tensors.items() if "::" not in k}
            optimizer = {k: v for k, v in tensors.items() if "::" in k}
        session.policy.load_weights(weights, field)
        if load_optimizer:
            session.load_optimizer_tensors(optimizer)

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
        if adapter:
            raw = json.loads((source / "adapter_config.json").read_text())
            lora_config = LoraConfig(
                rank=raw["r"],
                alpha=raw["lora_alpha"],
                dropout=raw.get("lora_dropout", 0.0),
                train_unembed=_targets_head(raw.get("target_modules"), self.model),
            )
            weights = load_file(str(source / "adapter_model.safetensors"))
        else:
            lora_config = LoraConfig()
            weights = read_model_weights(source)
        self._check_rank(lora_config, field, f"{source.name}: the adapter's ")
        untie = adapter and not self.lora and lora_config.train_unembed
        session = self._new_session(session_id, spec, lora_config, untie_head=untie)
        try:
            if self.lora:
                session.policy.load_weights(weights, field)
            elif adapter:
                session.policy.load_weights(
                    _merge_adapter(session.policy, weights, lora_config), field
                )
            else:
                params = session.policy.trainable
                tied = {n: weights.get(n, weights.get(_tied_source(n))) for n in params}
                session.policy.load_weights({n: t for n, t in tied.items() if t is not None}, field)
            session.policy.publish()
        except ValueError as exc:
            session.close()
            raise invalid(field, str(exc)) from None
        self.sessions[session_id] = session
        return session

    def close_session(self, session_id: str) -> None:
        session = self.sessions.pop(session_id, None)
        if session is not None and session.active:
            session.close()

    def close(self) -> None:
        with self.lock:
            for session_id in list(self.sessions):
                self.close_session(session_id)
            self.model = None  # type: ignore[assignment]
            self._peft = {"model": None}
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def read_sharded(directory: Path) -> dict[str, torch.Tensor]:
    """Full tensors from a checkpoint saved by `torch.distributed.checkpoint` in the
    Hugging Face layout (one safetensors file per rank; each header holds the offsets of its
    slices), assembled in this process without a process group. No pickle is read."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

    reader = HuggingFaceStorageReader(str(directory))
    metadata = reader.read_metadata().state_dict_metadata
    tensors: dict[str, Any] = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)  # type: ignore[union-attr]
        for key, meta in metadata.items()
    }
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.filterwarnings("ignore", message=".*single process.*")
        reader = HuggingFaceStorageReader(str(directory))
        dcp.load(tensors, storage_reader=reader, no_dist=True)
    return tensors


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


def _tied_source(name: str) -> str:
    """lm_head.weight of a tied checkpoint is stored under the input embedding's name."""
    return "model.embed_tokens.weight" if name == "lm_head.weight" else name


def _targets_head(target_modules: Any, model: Any) -> bool:
    if not target_modules:
        return False
    names = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    return "lm_head" in names


def _merge_adapter(
    policy: Policy, adapter: dict[str, torch.Tensor], config: LoraConfig
) -> dict[str, torch.Tensor]:
    """Full weights = base + scale · B @ A for each adapted module of a PEFT adapter file."""
    scale = config.alpha / config.rank
    merged = {n: p.detach().clone() for n, p in policy.trainable.items()}
    for key, a in adapter.items():
        if ".lora_A." not in key:
            continue
        module = key.removeprefix("base_model.model.").split(".lora_A.")[0]
        b = adapter[key.replace(".lora_A.", ".lora_B.")]
        target = f"{module}.weight"
        if target not in merged:
            raise ValueError(f"adapter module {module} is not in this model")
        merged[target] = merged[target] + scale * (b.float() @ a.float()).to(merged[target].dtype)
    return merged
