"""What a session trains: a LoRA adapter on a shared base, or the full weights.

A policy owns the trainable tensors of one session under canonical names (peft's adapter-free
state-dict keys for LoRA, the model's parameter names for full weights), the *published* copy
the generator samples from, and the exports. The two kinds share one interface, so the session
code never asks which one it has.

Isolation of LoRA sessions: each session is its own named peft adapter (`s<n>`), with a second
adapter (`s<n>p`) holding its published weights. Only the active adapter takes part in a
forward pass, the optimizer of a session holds only its adapter's tensors, and every compute
call activates its adapter under the resource lock.
"""

from __future__ import annotations

import abc
import contextlib
import copy
import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed
from torch import nn

from trainer.compute.lora_targets import (
    peft_lora_config,
    quiet_peft_warnings,
    unwrapped,
    v5_targets,
)
from trainer.compute.model import is_tied
from trainer.contract.specs import LoraConfig

if TYPE_CHECKING:
    from peft import LoraConfig as PeftLoraConfig
    from peft import PeftModel
    from peft.tuners.lora import LoraModel


class Policy(abc.ABC):
    """Interface shared by the LoRA and the full-weight policies.

    What the schedulers and the checkpoint layout ask of a policy are its properties below:
    the LoRA facts are None, False or empty for full weights."""

    kind: str
    trainable: dict[str, nn.Parameter]

    @property
    @abc.abstractmethod
    def model(self) -> Any:
        """The transformers model whose forward uses the active weights."""

    @property
    def config(self) -> LoraConfig | None:
        """The LoRA config it trains with (rank, alpha, dropout, head); None: full weights."""
        return None

    @property
    def seed(self) -> int | None:
        """The seed its LoRA weights were initialised from; None: full weights."""
        return None

    @property
    def adapter(self) -> str | None:
        """The name of its trainable peft adapter; None: full weights."""
        return None

    @property
    def published_adapter(self) -> str | None:
        """The name of the peft adapter the generator samples with; None: full weights."""
        return None

    @property
    def peft(self) -> PeftModel | None:
        """The resource's peft model, which holds its adapters; None: full weights."""
        return None

    @property
    def segmentable(self) -> bool:
        """Whether `trainer.compute.multilora.segmented` can run its adapter next to other
        sessions' in one forward (shared passes, batched samples): LoRA on modules only."""
        return False

    @property
    def expert_factors(self) -> dict[str, int]:
        """Canonical name -> number of experts, for the LoRA factors of fused expert stacks
        (empty: none, or full weights)."""
        return {}

    @contextlib.contextmanager
    def training(self, train: bool) -> Iterator[None]:
        """Make this session's trainable weights the active ones (train or eval mode)."""
        module = self._activate_trainable()
        module.train(train)
        try:
            yield
        finally:
            module.eval()

    @abc.abstractmethod
    def _activate_trainable(self) -> nn.Module:
        """Make the trainable weights the active ones; the module whose mode `training` sets."""

    @abc.abstractmethod
    def published(self) -> contextlib.AbstractContextManager[nn.Module]:
        """Make the published weights the active ones; yields the model to sample from."""

    @abc.abstractmethod
    def published_tensors(self) -> dict[str, torch.Tensor]:
        """The generator's weights under the canonical names (empty without a generator)."""

    def publish(self, snapshot: dict[str, torch.Tensor] | None = None) -> None:
        """Copy the trainable weights (or an earlier snapshot of them) to the generator."""
        source = snapshot if snapshot is not None else self.trainable
        with torch.no_grad():
            for name, tensor in self.published_tensors().items():
                tensor.copy_(source[name])

    def swap_published(self, snapshot: dict[str, torch.Tensor]) -> None:
        """Exchange the generator's weights with `snapshot`, in place and bit for bit: the
        generator serves the snapshot and the snapshot holds what the generator served, so a
        second swap undoes the first. No second copy of the weights is made."""
        with torch.no_grad():
            for name, tensor in self.published_tensors().items():
                held = tensor.clone()
                tensor.copy_(snapshot[name])
                snapshot[name].copy_(held)

    @abc.abstractmethod
    def export_parts(self) -> tuple[Any, dict[str, torch.Tensor], Any]:
        """What an inference export needs: the model whose weights are merged, the LoRA deltas
        to merge into them (none for full weights), and the PEFT adapter as
        `(tensors, adapter_config)` for LoRA, else None. `training_state.write_inference`
        lays them out."""

    def adapter_parts(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
        """The PEFT adapter alone, `(tensors, adapter_config)` on the CPU, for LoRA; None for
        full weights. An adapter export needs nothing else (no deltas, no merged model)."""
        return None

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in self.trainable.items()}

    def load_weights(self, weights: dict[str, torch.Tensor], where: str) -> None:
        """Copy tensors by canonical name into the trainable weights (all names must match)."""
        missing = sorted(set(self.trainable) - set(weights))
        unexpected = sorted(set(weights) - set(self.trainable))
        if missing or unexpected:
            raise ValueError(
                f"{where}: weights do not match this model "
                f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
            )
        with torch.no_grad():
            for name, param in self.trainable.items():
                if weights[name].shape != param.shape:
                    raise ValueError(
                        f"{where}: {name} has shape {tuple(weights[name].shape)}, "
                        f"expected {tuple(param.shape)}"
                    )
            for name, param in self.trainable.items():
                param.copy_(layout_like(param, weights[name]))

    @abc.abstractmethod
    def close(self) -> None:
        """Release what this policy holds on the resource."""


class SharedPeft:
    """A LoRA resource's one peft model: its first session's policy wraps the base model in
    it, each later one adds its adapters to it. None before the first session and once the
    resource has closed."""

    def __init__(self) -> None:
        self.model: PeftModel | None = None

    def add(self, base: nn.Module, config: PeftLoraConfig, name: str) -> PeftModel:
        """Adapter `name` with peft LoRA config `config`, on the shared model."""
        if self.model is None:
            from peft import get_peft_model

            self.model = cast("PeftModel", get_peft_model(base, config, adapter_name=name))
        else:
            self.model.add_adapter(name, config)
        return self.model

    def close(self) -> None:
        self.model = None


def train_only(peft: nn.Module, adapters: set[str]) -> None:
    """Exactly these adapters' LoRA weights of `peft` take gradients (peft's `set_adapter`
    may leave others trainable)."""
    for module in peft.modules():
        if hasattr(module, "lora_A"):
            layer: Any = module
            for key in layer.lora_A:
                layer.lora_A[key].requires_grad_(key in adapters)
                layer.lora_B[key].requires_grad_(key in adapters)


class LoraPolicy(Policy):
    kind = "lora"

    def __init__(
        self,
        resource_model: Any,
        shared: SharedPeft,
        name: str,
        config: LoraConfig,
        seed: int,
        with_generator: bool,
    ) -> None:
        self.name = name
        self.pub_name = f"{name}p"
        self._config = config
        self._seed = seed
        peft_config = peft_lora_config(resource_model, config)
        # Once a first adapter is in, the linear leaves include peft's own (`base_layer`, the
        # adapters' names): they are not targets, and must not reach adapter_config.json.
        inner = {"base_layer"} | {
            key
            for module in resource_model.modules()
            if hasattr(module, "lora_A")
            for key in module.lora_A
        }
        if not isinstance(peft_config.target_modules, str):  # a composite's regex: exact
            peft_config.target_modules = set(peft_config.target_modules) - inner
        device = resource_model.get_input_embeddings().weight.device
        with (
            quiet_peft_warnings(),
            v5_targets(),
            torch.random.fork_rng(devices=cuda_devices(device)),
        ):
            torch.manual_seed(seed)
            self._peft = shared.add(resource_model, peft_config, name)
            if config.init_method == "nora":
                nora_(self._peft, name)
            if with_generator:
                self._peft.add_adapter(self.pub_name, peft_config)
        self.with_generator = with_generator
        suffix = f".{name}."
        self.trainable = {
            n.replace(suffix, "."): p for n, p in self._peft.named_parameters() if suffix in n
        }
        self._pub = {
            n.replace(f".{self.pub_name}.", "."): p
            for n, p in self._peft.named_parameters()
            if f".{self.pub_name}." in n
        }
        self._expert_factors = self._find_expert_factors()
        # LoRA on parameters (peft's ParamWrapper: an MoE block's fused experts) is beyond
        # `trainer.compute.multilora.segmented` (shared passes, batched samples): such
        # sessions run alone
        self._segmentable = not any(
            hasattr(m, "parameter_name") and name in cast(Any, m).lora_A
            for m in self._peft.modules()
        )
        self.trainable_requires_grad()
        self.publish()

    @property
    def _tuner(self) -> LoraModel:
        """peft's LoRA tuner inside the shared model (it holds every adapter)."""
        return cast("LoraModel", self._peft.base_model)

    @property
    def model(self) -> Any:
        return self._tuner.model

    @property
    def config(self) -> LoraConfig:
        return self._config

    @property
    def seed(self) -> int:
        return self._seed

    @property
    def adapter(self) -> str:
        return self.name

    @property
    def published_adapter(self) -> str:
        return self.pub_name

    @property
    def peft(self) -> PeftModel:
        return self._peft

    @property
    def segmentable(self) -> bool:
        return self._segmentable

    @property
    def expert_factors(self) -> dict[str, int]:
        return self._expert_factors

    def trainable_requires_grad(self) -> None:
        for param in self.trainable.values():
            param.requires_grad_(True)

    def _activate(self, adapter: str) -> None:
        with quiet_peft_warnings():
            self._tuner.set_adapter(adapter)
        train_only(self.peft, {adapter})

    def _activate_trainable(self) -> nn.Module:
        self._activate(self.name)
        return cast(nn.Module, self.peft)

    @contextlib.contextmanager
    def published(self) -> Iterator[nn.Module]:
        if not self.with_generator:
            raise RuntimeError("this resource has no generator")
        self._activate(self.pub_name)
        self.peft.eval()
        yield self.model

    def published_tensors(self) -> dict[str, torch.Tensor]:
        return dict(self._pub) if self.with_generator else {}

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """peft's adapter-free keys (`...q_proj.lora_A.weight`), on CPU."""
        return {name: p.detach().to("cpu").clone() for name, p in self.trainable.items()}

    def peft_config_dict(self) -> dict[str, Any]:
        config = self.peft.peft_config[self.name].to_dict()
        if not isinstance(config["target_modules"], str):
            config["target_modules"] = sorted(config["target_modules"])
        config["base_model_name_or_path"] = None
        config.pop("runtime_config", None)
        return json.loads(json.dumps(config, default=_jsonable))

    def delta_on_this_rank(self) -> bool:
        """Whether this rank's shards of the adapter change the model: some `lora_B` factor
        is non-zero (every initialisation here starts B at zero, so a fresh adapter has none)."""
        from torch.distributed.tensor import DTensor

        factors = [p.detach() for name, p in self.trainable.items() if "lora_B" in name]
        local = [p.to_local() if isinstance(p, DTensor) else p for p in factors]
        return any(bool(p.count_nonzero()) for p in local)

    def lora_deltas(self) -> dict[str, torch.Tensor]:
        """Module path -> weight delta; for LoRA on a parameter (an MoE block's fused 3-D
        experts), the parameter's own name (`model.layers.0.mlp.experts.down_proj`)."""
        deltas = {}
        for path, module in self.model.named_modules():
            if hasattr(module, "lora_A") and self.name in module.lora_A:
                parameter = getattr(module, "parameter_name", None)
                if parameter is not None:
                    path = f"{unwrapped(path)}.{parameter}"
                deltas[path] = module.get_delta_weight(self.name).detach()
        return deltas

    def _find_expert_factors(self) -> dict[str, int]:
        """Canonical name -> number of experts, for the LoRA factors of fused expert stacks
        (peft's ParamWrapper: `lora_A` is (experts·r, in), `lora_B` is (out, r·experts))."""
        suffix = f".{self.name}."
        out: dict[str, int] = {}
        for path, module in self.peft.named_modules():
            experts = getattr(module, "num_experts", None)
            if getattr(module, "parameter_name", None) is None or experts is None:
                continue
            if experts > 1 and self.name in module.lora_A:
                for kind in ("lora_A", "lora_B"):
                    for name, _ in getattr(module, kind)[self.name].named_parameters():
                        out[f"{path}.{kind}{suffix}{name}".replace(suffix, ".")] = experts
        return out

    def adapter_parts(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return self.adapter_state(), self.peft_config_dict()

    def export_parts(self) -> tuple[Any, dict[str, torch.Tensor], Any]:
        return self.model, self.lora_deltas(), self.adapter_parts()

    def close(self) -> None:
        with quiet_peft_warnings():
            for adapter in (self.name, self.pub_name):
                if adapter in self.peft.peft_config:
                    if len(self.peft.peft_config) == 1:
                        # peft refuses to delete the last adapter: zero it and keep it idle
                        self._zero(adapter)
                        continue
                    self._tuner.delete_adapter(adapter)

    def _zero(self, adapter: str) -> None:
        with torch.no_grad():
            for n, p in self.peft.named_parameters():
                if f".{adapter}." in n:
                    p.zero_()
                    p.requires_grad_(False)


def nora_(peft: nn.Module, adapter: str) -> None:
    """NoRA init (docs/semantics.md §23): each input column of the adapter's every A (`[rank,
    in]`: the column's weights over the rank) scaled to unit L2 norm, in place."""
    with torch.no_grad():
        for module in peft.modules():
            lora_a = getattr(module, "lora_A", None)
            if isinstance(lora_a, nn.ModuleDict) and adapter in lora_a:
                weight = cast(torch.Tensor, lora_a[adapter].weight)
                weight.div_(weight.norm(dim=0, keepdim=True).clamp_min(1e-12))


class FullPolicy(Policy):
    kind = "full"

    def __init__(self, resource_model: Any, with_generator: bool) -> None:
        self._model = resource_model
        self._model.requires_grad_(True)
        self.trainable = dict(self._model.named_parameters())
        self.generator = (
            copy.deepcopy(self._model).requires_grad_(False) if with_generator else None
        )
        self.tied = is_tied(self._model)

    @property
    def model(self) -> Any:
        return self._model

    def _activate_trainable(self) -> nn.Module:
        return cast(nn.Module, self._model)

    @contextlib.contextmanager
    def published(self) -> Iterator[nn.Module]:
        if self.generator is None:
            raise RuntimeError("this resource has no generator")
        self.generator.eval()
        yield self.generator

    def published_tensors(self) -> dict[str, torch.Tensor]:
        return {} if self.generator is None else dict(self.generator.named_parameters())

    def export_parts(self) -> tuple[Any, dict[str, torch.Tensor], Any]:
        return self._model, {}, None

    def close(self) -> None:
        self._model.requires_grad_(False)
        for param in self._model.parameters():
            param.grad = None
        self.generator = None


def cuda_devices(device: torch.device | None = None) -> list[int]:
    """The CUDA devices whose RNG a session owns: the one it computes on (`device`: none for
    the CPU, so a CPU worker on a GPU host never opens a CUDA context), its own under
    torch.distributed (one device per rank), else every visible one."""
    if not torch.cuda.is_available() or (device is not None and device.type != "cuda"):
        return []
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return [torch.cuda.current_device()]
    if device is not None:
        return [device.index if device.index is not None else torch.cuda.current_device()]
    return list(range(torch.cuda.device_count()))


def layout_like(param: torch.Tensor, value: torch.Tensor, cast: bool = True) -> torch.Tensor:
    """`value` (a full tensor) on `param`'s device (and dtype with `cast`), and sharded like
    `param` when that is an FSDP2 DTensor (each rank keeps its own slice: no communication)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    dtype = param.dtype if cast else value.dtype
    if isinstance(param, DTensor) and not isinstance(value, DTensor):
        local = value.to(param.to_local().device, dtype)
        return distribute_tensor(local, param.device_mesh, param.placements, src_data_rank=None)
    return value.to(param.device, dtype) if cast else value.to(param.device)


def _jsonable(value: Any) -> Any:
    if isinstance(value, set):
        return sorted(value)
    return str(value)
