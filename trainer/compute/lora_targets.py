"""What a LoRA adapter targets (docs/semantics.md §20): the language model's linear layers that
the model calls (and its head with `train_unembed`), its real expert stacks as parameters, and
the peft config that says so.

peft (≥ 0.22) rewrites a LoRA config's targets for some mixture-of-experts model types, reading
them as transformers v4 expert names so that adapters trained before v5 still load. The targets
here name v5 modules and parameters: on a model with expert stacks they are the modules' own
paths, which the rewrite leaves alone, and while the worker adds its own adapters the rewrite is
off (`v5_targets`): on a model that already holds an adapter it would take the wrapped layers
for experts and add a rank-doubled fused target.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Iterator
from typing import Any

from torch import nn

from trainer.compute import architecture
from trainer.contract.errors import invalid
from trainer.contract.specs import LoraConfig


def lora_target_modules(model: Any, train_unembed: bool) -> list[str] | str:
    """Every linear layer of the decoder (leaf names), plus the output head with train_unembed.

    Like peft's "all-linear" but explicit, so the head can be added as a real LoRA target
    (not `modules_to_save`, which inference servers reject). On a composite model (a language
    model beside a vision or audio tower) the leaf names would match the towers' layers too,
    so the targets are a regex over the language model's module paths: the towers stay frozen
    and untouched (text-only training; docs/semantics.md §20).

    The targets are the modules' own paths instead where leaf names would say more than is
    meant: when a layer name is adapted in one module and read directly in another
    (`_read_directly`), and on a model with expert stacks, whose leaf names peft (≥ 0.22) takes
    for transformers v4 expert names and rewrites (a dense `gate_proj` beside fused experts
    would add a rank-doubled `gate_up_proj` target).
    """
    decoder = model.get_decoder()
    linear = {
        name
        for name, mod in decoder.named_modules()
        if _is_linear(mod)
        and not any(p == "base_layer" or p.startswith("lora_") for p in name.split("."))
    }
    read = _read_directly(decoder)
    names = sorted({name.rsplit(".", 1)[-1] for name in linear - read})
    head_name = head_attr(model)
    prefix = _decoder_path(model)
    clash = bool({name.rsplit(".", 1)[-1] for name in read} & set(names))
    composite = prefix is not None and _has_other_towers(model, prefix)
    if clash or (lora_target_parameters(model) and not composite):
        paths = sorted(f"{prefix}.{name}" if prefix else name for name in linear - read)
        return [*paths, head_name] if train_unembed else paths
    if composite and prefix is not None:
        leaves = "|".join(re.escape(name) for name in names)
        pattern = rf"{re.escape(prefix)}\..*\.({leaves})"
        return f"^(?:{pattern}|{re.escape(head_name)})$" if train_unembed else f"^{pattern}$"
    if train_unembed:
        names.append(head_name)
    return names


def _read_directly(decoder: nn.Module) -> set[str]:
    """The linear layers of state-space (Mamba) mixers, a module holding `A_log` and `D`,
    other than their `in_proj`: their weights are read directly rather than called (Jamba's
    `dt_proj` always; the fused Mamba kernels' `x_proj`, `dt_proj` and `out_proj`), so a LoRA
    on them would be skipped. Not LoRA targets (docs/semantics.md §20)."""
    out: set[str] = set()
    for name, module in decoder.named_modules():
        own = {n for n, _ in module.named_parameters(recurse=False)}
        if {"A_log", "D"} <= own:
            for child, sub in module.named_children():
                if _is_linear(sub) and child != "in_proj":
                    out.add(f"{name}.{child}" if name else child)
    return out


def _decoder_path(model: Any) -> str | None:
    decoder = model.get_decoder()
    for name, module in model.named_modules():
        if module is decoder:
            return name
    return None


def _has_other_towers(model: Any, decoder_path: str) -> bool:
    """Whether linear layers live outside the decoder and the output head (a vision tower,
    a multimodal projector)."""
    head = head_attr(model)
    for name, module in model.named_modules():
        # the decoder, and the head with what peft puts in it (`base_layer`, `lora_A`, ...)
        inside = any(name == p or name.startswith(p + ".") for p in (decoder_path, head))
        if _is_linear(module) and not inside:
            return True
    return False


def lora_target_parameters(model: Any) -> list[str]:
    """The fused expert weights of the decoder's MoE blocks, for peft's `target_parameters`
    (`experts.gate_up_proj`, `experts.down_proj` in transformers 5's Qwen3-MoE): every 3-D
    parameter whose first dimension is the config's number of experts, outside any
    convolution (a linear-attention layer's conv kernel is 3-D too, and is not an expert
    stack), named `<module leaf>.<parameter>`. Empty for a dense model. The router (a 2-D
    parameter of its own module) is not among them. Sorted, so that peft nests its wrappers,
    and names the adapter's keys, the same way on every load."""
    decoder = model.get_decoder()
    experts = num_experts(model)
    if experts is None:
        return []
    names = set()
    for module_name, module in decoder.named_modules():
        if isinstance(module, nn.modules.conv._ConvNd):
            continue
        for param_name, param in module.named_parameters(recurse=False):
            if param.dim() == 3 and param.shape[0] == experts:
                leaf = unwrapped(module_name).rsplit(".", 1)[-1]  # without peft's wrappers
                names.add(f"{leaf}.{param_name}")
    return sorted(names)


def num_experts(model: Any) -> int | None:
    """The number of routed experts its config declares (None: a dense model)."""
    return architecture.describe_experts(architecture.text_config(model))


def unwrapped(path: str) -> str:
    """A module path or parameter name without peft's (possibly nested) `.base_layer` parts."""
    return re.sub(r"\.base_layer(?=\.|$)", "", path)


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Linear"


def head_attr(model: Any) -> str:
    head = model.get_output_embeddings()
    for name, module in model.named_children():
        if module is head:
            return name
    raise ValueError("the model's output head is not a direct child module")


def peft_lora_config(model: Any, config: LoraConfig) -> Any:
    from peft import LoraConfig as PeftLoraConfig

    experts = lora_target_parameters(model)
    if experts and config.dropout > 0:
        # peft's ParamWrapper (LoRA on a parameter) cannot apply dropout to its input
        raise invalid(
            "lora_config.dropout",
            "LoRA dropout is not supported on mixture-of-experts models "
            "(the expert weights are adapted as parameters); use 0",
        )
    if experts and config.init_method == "nora":
        raise invalid(
            "lora_config.init_method",
            "nora is not served on mixture-of-experts models (the expert weights are adapted "
            "as parameters); use kaiming",
        )
    extra: dict[str, Any] = {"target_parameters": experts} if experts else {}
    return PeftLoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=lora_target_modules(model, config.train_unembed),
        bias="none",
        task_type="CAUSAL_LM",
        **extra,
    )


@contextlib.contextmanager
def quiet_peft_warnings() -> Iterator[None]:
    """peft warns about LoRA on a tied head; we never merge in place, so the warning is moot."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        warnings.filterwarnings("ignore", message=".*should not be contained in the prefix.*")
        warnings.filterwarnings("ignore", message=".*was active which is now deleted.*")
        yield


@contextlib.contextmanager
def v5_targets() -> Iterator[None]:
    """peft's v4-to-v5 rewrite of LoRA targets off while this runs (the module docstring).
    Adapters are added under the compute lock, one at a time."""
    try:
        from peft.utils import transformers_weight_conversion as conversion
    except ImportError:  # a peft without the rewrite
        yield
        return
    kept = conversion.convert_peft_config_for_transformers

    def unchanged(*_args: Any, **_kwargs: Any) -> None:
        return None

    conversion.convert_peft_config_for_transformers = unchanged
    try:
        yield
    finally:
        conversion.convert_peft_config_for_transformers = kept
