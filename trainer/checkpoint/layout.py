"""A training checkpoint's layout, written and read in one place, for LoRA and full weights,
one rank or many.

Design notes: `docs/design/checkpoints.md`.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from trainer.checkpoint.export import AdapterExport, from_tinker, write_adapter
from trainer.checkpoint.store import (
    ADAPTER_DIR,
    MERGED_DIR,
    TRAINING,
    CheckpointRecord,
    save_tensors,
    write_json,
)
from trainer.compute import optim
from trainer.compute.model import read_weights_as, save_merged
from trainer.contract.specs import LoraConfig

if TYPE_CHECKING:
    from trainer.compute.placement import Communicator
    from trainer.compute.policy import Policy
    from trainer.contract.specs import ModelEntry, ResourceSpec, SessionSpec


class _ResourceFacts(Protocol):
    @property
    def entry(self) -> ModelEntry: ...

    @property
    def spec(self) -> ResourceSpec: ...


class _Counters(Protocol):
    @property
    def trainer_step(self) -> int: ...


class SessionState(Protocol):
    """What a checkpoint holds of a session, and how to read it back into one."""

    spec: SessionSpec
    policy: Policy
    optimizer: torch.optim.Optimizer
    rng_seed: int
    step: int

    @property
    def resource(self) -> _ResourceFacts: ...

    @property
    def versions(self) -> _Counters: ...

    @property
    def comm(self) -> Communicator: ...

    def operation_scope(self) -> contextlib.AbstractContextManager[Any]: ...

    def rng_tensors(self) -> dict[str, torch.Tensor]: ...

    def restore_rng(self, tensors: dict[str, torch.Tensor]) -> None: ...

    def restore_counters(self, step: int, trainer_step: int) -> None: ...


CHECKPOINT_FORMAT = 1
SHARDED_DIR = "sharded"  # a multi-rank training checkpoint's tensors (weights + optimizer)


def state_json(session: SessionState) -> dict[str, Any]:
    config = session.policy.config
    state = {
        "format": CHECKPOINT_FORMAT,
        "kind": session.policy.kind,
        "base_model": session.resource.entry.name,
        "step": session.step,
        "trainer_step": session.versions.trainer_step,
        "lora_config": None if config is None else config.model_dump(),
        "lora_seed": session.policy.seed,
        "rng_seed": session.rng_seed,
        "session_spec": json.loads(session.spec.model_dump_json()),
        "resource_spec": json.loads(session.resource.spec.model_dump_json()),
    }
    if session.comm.world_size > 1:
        state["world_size"] = session.comm.world_size
    return state


def is_sharded(session: SessionState) -> bool:
    return any(isinstance(p, DTensor) for p in session.policy.trainable.values())


def write_training(session: SessionState, out: Path) -> None:
    """Fill `out` (rank 0's fresh directory; the other ranks receive its path) from the live
    tensors, under the session's operation scope, with no copy-out: every rank writes its DCP
    shards, rank 0 the replicated files. Largest first: its sha256 starts while the others are
    written (row 6). Collective."""
    comm = session.comm
    out = Path(comm.broadcast_json(str(out)))
    with session.operation_scope():
        trainable = session.policy.trainable
        weights = {n: p.detach() for n, p in trainable.items()}
        optimizer = optim.state_tensors(session.optimizer, trainable, copy=False)
        if is_sharded(session):
            _dcp_save({**weights, **optimizer}, out / SHARDED_DIR, comm)
        if comm.rank == 0:
            if not is_sharded(session):
                save_tensors(optimizer, out / "optimizer.safetensors")
                save_tensors(weights, out / "weights.safetensors")
            save_tensors(session.rng_tensors(), out / "rng.safetensors")
            write_json(out / "state.json", state_json(session))
    comm.barrier()


def _dcp_save(tensors: dict[str, torch.Tensor], directory: Path, comm: Communicator) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

    directory.mkdir(parents=True, exist_ok=True)
    writer = HuggingFaceStorageWriter(str(directory), save_distributed=True)
    dcp.save(dict(tensors), storage_writer=writer, process_group=comm.control)


def read_state(path: Path) -> dict[str, Any]:
    """A checkpoint's `state.json` (training and inference checkpoints both have one)."""
    state: dict[str, Any] = json.loads((path / "state.json").read_text())
    return state


def lora_config_of(state: dict[str, Any]) -> LoraConfig:
    # a file's values, not a request's: read as leniently as when they were written
    config = state["lora_config"]
    return LoraConfig.model_validate(config, strict=False) if config else LoraConfig()


def write_inference(
    policy: Policy, out: Path, tokenizer: Any, source: Any = None, dtype: Any = None
) -> None:
    """An inference checkpoint's servable weights: `adapter/` (PEFT files, LoRA only) and
    `merged/` (a model plain `transformers` loads, tied heads untied, the base never merged
    in place; with `dtype`, rounded to it). `source` stands in for the model when its
    `state_dict()` comes from elsewhere (shards gathered to rank 0)."""
    model, deltas, adapter = policy.export_parts()
    if adapter is not None:
        tensors, config = adapter
        write_adapter(out / ADAPTER_DIR, tensors, config, AdapterExport(naming="peft"))
    merged_from = model if source is None else source
    save_merged(merged_from, out / MERGED_DIR, deltas, tokenizer, dtype)


def write_export(policy: Policy, out: Path, export: AdapterExport) -> None:
    """An adapter export's servable weights: `adapter/` alone, in the export's naming and
    encrypted to its recipients (`checkpoint/export.py`); no merged model."""
    adapter = policy.adapter_parts()
    if adapter is None:
        raise ValueError("export: an adapter export needs a LoRA session")
    tensors, config = adapter
    write_adapter(out / ADAPTER_DIR, tensors, config, export)


def inference_weights(path: Path, lora: bool) -> Path:
    """The directory an inference checkpoint resumes from: its PEFT adapter, or merged model."""
    return path / (ADAPTER_DIR if lora else MERGED_DIR)


def read_training(
    session: SessionState,
    path: Path,
    state: dict[str, Any],
    load_optimizer: bool,
    field: str,
) -> None:
    """A training checkpoint into a new session: the weights, and with `load_optimizer` the
    optimizer state, RNG states and counters too."""
    _read_tensors(session, path, load_optimizer, field)
    if load_optimizer:
        session.restore_rng(load_file(str(path / "rng.safetensors")))
        session.restore_counters(state["step"], state["trainer_step"])


def _read_tensors(session: SessionState, path: Path, load_optimizer: bool, field: str) -> None:
    if is_sharded(session):
        _dcp_load(session, path, load_optimizer, field)
        return
    if (path / "weights.safetensors").exists():
        weights = load_file(str(path / "weights.safetensors"))
        optimizer = load_file(str(path / "optimizer.safetensors")) if load_optimizer else {}
    else:  # written by several ranks
        tensors = read_sharded(path / SHARDED_DIR)
        weights = {k: v for k, v in tensors.items() if "::" not in k}
        optimizer = {k: v for k, v in tensors.items() if "::" in k}
    session.policy.load_weights(weights, field)
    if load_optimizer:
        optim.load_state_tensors(session.optimizer, session.policy.trainable, optimizer)


def _dcp_load(session: SessionState, path: Path, load_optimizer: bool, field: str) -> None:
    """DCP-load straight into this rank's shards, from the single-process files or from
    shards written under any world size. Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

    if (path / "weights.safetensors").exists():
        directory = path
        with safe_open(str(path / "weights.safetensors"), framework="pt") as fh:
            names = set(fh.keys())
    else:
        directory = path / SHARDED_DIR
    stored = HuggingFaceStorageReader(str(directory)).read_metadata().state_dict_metadata
    if directory != path:
        names = {key for key in stored if "::" not in key}
    trainable = session.policy.trainable
    if names != set(trainable):
        missing, unexpected = sorted(set(trainable) - names), sorted(names - set(trainable))
        raise ValueError(
            f"{field}: weights do not match this model "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    targets: dict[str, Any] = {name: p.detach() for name, p in trainable.items()}
    slots: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    if load_optimizer:
        for key, meta in stored.items():
            name, _, slot = key.rpartition("::")
            if name in trainable:
                param = trainable[name]
                value = (
                    torch.zeros(meta.size, dtype=meta.properties.dtype)  # type: ignore[union-attr]
                    if slot == "step"
                    else torch.zeros_like(param.detach())
                )
                slots[name][slot] = targets[key] = value
    reader = HuggingFaceStorageReader(str(directory))
    dcp.load(targets, storage_reader=reader, process_group=session.comm.control)
    for name, state in slots.items():
        session.optimizer.state[trainable[name]] = state


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


def read_directory(
    source: Path, adapter: bool, model: Any, trust_remote_code: bool
) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    """A PEFT adapter directory (its LoRA config and tensors, in PEFT's naming or Tinker's)
    or a full model directory (the default config and its weights under `model`'s names): an
    inference checkpoint's, an adapter export's or a Hugging Face one."""
    if not adapter:
        return LoraConfig(), read_weights_as(model, source, trust_remote_code)
    raw = json.loads((source / "adapter_config.json").read_text())
    targets = raw.get("target_modules")
    names = [targets] if isinstance(targets, str) else list(targets or [])
    fields = {
        "rank": raw["r"],
        "alpha": raw["lora_alpha"],
        "dropout": raw.get("lora_dropout", 0.0),
        "train_unembed": (
            "lm_head" in targets  # a composite's regex names the head in its alternatives
            if isinstance(targets, str)
            else "lm_head" in names or "unembed_tokens" in names
        ),
    }
    config = LoraConfig.model_validate(fields, strict=False)  # PEFT may write 16.0 for 16
    return config, from_tinker(load_file(str(source / "adapter_model.safetensors")))


def load_directory_weights(
    policy: Policy,
    weights: dict[str, torch.Tensor],
    adapter: bool,
    config: LoraConfig,
    field: str,
) -> None:
    """`read_directory`'s tensors into a new session: an adapter as it is (LoRA) or merged
    into the base (full weights); a full model's weights by name (a tied head from the
    embedding)."""
    if policy.kind == "lora":
        policy.load_weights(weights, field)
    elif adapter:
        policy.load_weights(_merge_adapter(policy, weights, config), field)
    else:
        tied = {n: weights.get(n, weights.get(tied_source(n))) for n in policy.trainable}
        policy.load_weights({n: t for n, t in tied.items() if t is not None}, field)


def tied_source(name: str) -> str:
    """lm_head.weight of a tied checkpoint is stored under the input embedding's name."""
    return "model.embed_tokens.weight" if name == "lm_head.weight" else name


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
        if ".base_layer" in module or target not in merged:
            target, delta = _expert_delta(merged, module, a.float(), b.float())
        else:
            delta = b.float() @ a.float()
        merged[target] = merged[target] + (scale * delta).to(merged[target].dtype)
    return merged


def _expert_delta(
    merged: dict[str, torch.Tensor], module: str, a: torch.Tensor, b: torch.Tensor
) -> tuple[str, torch.Tensor]:
    """LoRA on a fused expert stack (peft's ParamWrapper, nested as `experts.base_layer…`):
    the stack whose per-expert (out, in) matches the factors, and its (experts, out, in)
    delta B_e @ A_e, with A (experts·r, in) and B (out, r·experts)."""
    owner = module.replace(".base_layer", "")
    stacks = [
        name
        for name, tensor in merged.items()
        if name.rpartition(".")[0] == owner
        and tensor.dim() == 3
        and tuple(tensor.shape[1:]) == (b.shape[0], a.shape[1])
    ]
    if len(stacks) != 1:
        raise ValueError(f"adapter module {module} is not in this model")
    experts = merged[stacks[0]].shape[0]
    if a.shape[0] % experts or b.shape[1] != a.shape[0]:
        raise ValueError(f"adapter module {module}: factors do not fit {experts} experts")
    delta = torch.einsum(
        "ore,eri->eoi", b.view(b.shape[0], -1, experts), a.view(experts, -1, a.shape[1])
    )
    return stacks[0], delta


def placeholder_record() -> CheckpointRecord:
    """Ranks ≠ 0 keep no catalogue: their result of a checkpoint call is never read."""
    return CheckpointRecord("", TRAINING, "", 0, "", None, 0.0, Path())
