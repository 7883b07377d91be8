"""Loading a base model, choosing LoRA targets, and exporting weights without touching the base.

A location is a local directory, a hub id (`org/name`), or `hf://org/name`. Hub access goes
through transformers / huggingface_hub, so `HF_HUB_OFFLINE`, `HF_HOME` and the cache are
respected. `trust_remote_code` is only ever passed through from the catalogue entry.

Loading is not thread-safe in transformers: `from_pretrained` changes process-global state
while it builds a model (`torch.set_default_dtype`, `PreTrainedModel.tie_weights`,
`torch.linspace` and the `torch.nn.init` functions are swapped and restored), and its lazy
module resolves classes on first use. Two loads at once could leave a tied head on the meta
device, or the swapped functions in place for good. So the classes are imported here, once, and
every load builds its model under `COMPUTE_LOCK`, which operations also hold: no thread computes
while the globals are swapped.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer  # eager: see the module docstring

from trainer.compute import architecture, precision, selfcheck
from trainer.compute.architecture import needs_eager
from trainer.compute.attention import use_packed_sdpa
from trainer.compute.lora_targets import head_attr, unwrapped
from trainer.compute.precision import DTYPES
from trainer.compute.turns import TurnLock
from trainer.contract.specs import ModelEntry

log = logging.getLogger(__name__)

# One lock for all torch work that reads or changes process-global state: operations (they swap
# their session's RNG state into the global torch RNG, and a worker drives one accelerator) and
# model loading (see the module docstring). Re-entrant: an operation may load weights. Fair
# (`trainer/compute/turns.py`): turns go in arrival order, and a long sample yields its turn between
# decode steps so that other sessions' operations are not stuck behind it.
COMPUTE_LOCK = TurnLock()

# config.json keys that hold a model's context length, in order of preference
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(entry_dtype: str, device: torch.device) -> torch.dtype:
    """bf16 on CUDA, fp32 on CPU, unless the catalogue entry says otherwise."""
    if entry_dtype != "auto":
        return DTYPES[entry_dtype]
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def hub_id(location: str) -> str:
    """`hf://org/name` → `org/name`; local paths and plain hub ids are returned as they are."""
    return location.removeprefix("hf://")


def local_dir(location: str, revision: str | None = None) -> Path:
    """A directory holding the files at `location`, downloading (or reading the cache) if needed."""
    path = Path(location).expanduser()
    if path.is_dir():
        return path
    if location.startswith(("/", "./", "../", "~")):
        raise FileNotFoundError(f"no such directory: {location}")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(hub_id(location), revision=revision))


def load_base_model(
    entry: ModelEntry, device: torch.device, load_on: torch.device | None = None
) -> tuple[Any, Any]:
    """Load the base model (and its tokenizer, when it has one) for a catalogue entry.

    `device` computes (it picks the dtype and the attention); the weights are read onto
    `load_on` (default: `device`; the CPU when they are sharded afterwards).
    Safe to call from several threads at once (loads take turns with each other and with
    operations; the download, if any, runs outside the lock)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    source = str(local_dir(entry.location, entry.revision))
    dtype = resolve_dtype(entry.dtype, device)
    with COMPUTE_LOCK:
        loader = model_loader(source, entry)
        attn = entry.attn_implementation or default_attention(source, device, entry, dtype)
        if entry.attn_implementation is not None:
            check_attention(source, entry)
        model = loader.from_pretrained(
            source,
            dtype=dtype,
            trust_remote_code=entry.trust_remote_code,
            attn_implementation=attn,
        )
        model.to(load_on or device)  # type: ignore[arg-type]
        reason = needs_eager(model)
        if reason and entry.attn_implementation is None and attn != "eager":
            log.info("%s: %s, so eager attention", entry.name, reason)
            attn = "eager"
            model.set_attn_implementation(attn)
        if attn == "sdpa":
            use_packed_sdpa(model)  # exact varlen attention for packed samples, else plain sdpa
        model.requires_grad_(False)
        model.eval()
        if load_on is None or load_on == device:
            selfcheck.prove(model)  # exact or refused (docs/semantics.md §20)
        else:  # loaded to be sharded: the layout its layers call for, checked on one device
            architecture.keep(model, architecture.describe(model))
        tokenizer = None
        if any(Path(source, name).exists() for name in ("tokenizer.json", "tokenizer_config.json")):
            tokenizer = AutoTokenizer.from_pretrained(
                source, trust_remote_code=entry.trust_remote_code
            )
    log.info("loaded %s from %s (%s, %s, attn=%s)", entry.name, source, dtype, device, attn)
    return model, tokenizer


def context_length(config: dict[str, Any]) -> int | None:
    """The longest sequence a model takes, from its config.json (None when it does not say)."""
    for section in (config, config.get("text_config")):
        if not isinstance(section, dict):
            continue
        for key in _POSITION_KEYS:
            value = section.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 2:
                return value
    return None


def read_model_config(location: str, revision: str | None = None) -> dict[str, Any]:
    """A model's config.json as a dict, without loading it (one small file from the hub)."""
    path = Path(location).expanduser()
    if path.is_dir():
        file = path / "config.json"
    elif location.startswith(("/", "./", "../", "~")):
        raise FileNotFoundError(f"no such directory: {location}")
    else:
        from huggingface_hub import hf_hub_download

        file = Path(hf_hub_download(hub_id(location), "config.json", revision=revision))
    config: dict[str, Any] = json.loads(file.read_text())
    return config


def with_context_limit(entry: ModelEntry, model_config: dict[str, Any]) -> ModelEntry:
    """The entry with `max_seq_length` set to the model's own context length, or to the
    configured one when that is smaller (an unset `max_seq_length` means the model's own)."""
    own = context_length(model_config)
    if own is None:
        return entry
    configured = "max_seq_length" in entry.model_fields_set
    limit = min(own, entry.max_seq_length) if configured else own
    if limit == entry.max_seq_length and configured:
        return entry
    return entry.model_copy(update={"max_seq_length": limit})


def resolve_context_limit(entry: ModelEntry) -> ModelEntry:
    """`with_context_limit` reading the model's config.json; the entry as it is when the
    config cannot be read now (it is applied again when the model loads)."""
    try:
        config = read_model_config(entry.location, entry.revision)
    except Exception as exc:  # offline, missing, unreadable: the resource load reports it
        log.warning("%s: cannot read its config.json yet (%s)", entry.name, exc)
        return entry
    return with_context_limit(entry, config)


def model_loader(source: str, entry: ModelEntry) -> Any:
    """The auto class that loads the checkpoint as its own architecture: a composite
    checkpoint (a `*ForConditionalGeneration`: a language model beside a vision tower) loads
    whole, so that its exports keep its class, config and towers; any other as a causal LM.
    Training is text-only either way (`lora_target_modules`)."""
    from transformers import AutoConfig, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    config = AutoConfig.from_pretrained(source, trust_remote_code=entry.trust_remote_code)
    composite = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(config.model_type)
    if composite is not None and composite in (getattr(config, "architectures", None) or []):
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


_SUPPORT_FLAGS = {
    "sdpa": "_supports_sdpa",
    "flash_attention_2": "_supports_flash_attn",
    "flash_attention_3": "_supports_flash_attn",
    "flex_attention": "_supports_flex_attn",
}


def check_attention(source: str, entry: ModelEntry) -> None:
    """A catalogue entry's `attn_implementation` that the model's class does not support is
    an error naming the field, before anything loads."""
    from transformers import AutoConfig

    attn = str(entry.attn_implementation)
    config = AutoConfig.from_pretrained(source, trust_remote_code=entry.trust_remote_code)
    flag = _SUPPORT_FLAGS.get(attn)
    model_class: Any = None
    with contextlib.suppress(KeyError, ValueError):  # remote code: transformers checks it
        model_class = model_loader(source, entry)._model_mapping[type(config)]
    if model_class is not None and flag is not None and not getattr(model_class, flag, True):
        raise ValueError(
            f"attn_implementation: {config.model_type} ({model_class.__name__}) does not "
            f"support {attn!r}; leave it unset to use the fastest it supports exactly"
        )


def default_attention(
    source: str, device: torch.device, entry: ModelEntry, dtype: torch.dtype
) -> str:
    """The fastest attention the model's class supports: FlashAttention-2 on CUDA when
    installed and the weights are 16-bit (it computes nothing else), else SDPA (made varlen
    by `use_packed_sdpa`), else eager. Attention that SDPA or FlashAttention-2 would compute
    wrongly (sinks, soft-capping) moves to eager after the load (`architecture.needs_eager`)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source, trust_remote_code=entry.trust_remote_code)
    model_class: Any = None
    with contextlib.suppress(KeyError, ValueError):
        model_class = model_loader(source, entry)._model_mapping[type(config)]
    supports = lambda flag: model_class is None or bool(getattr(model_class, flag, True))  # noqa: E731
    half = dtype in (torch.bfloat16, torch.float16)
    if device.type == "cuda" and half and _has_flash_attn() and supports("_supports_flash_attn"):
        return "flash_attention_2"
    if supports("_supports_sdpa"):
        return "sdpa"
    return "eager"


def _has_flash_attn() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def is_tied(model: Any) -> bool:
    head = model.get_output_embeddings()
    embed = model.get_input_embeddings()
    head_weight = getattr(head, "weight", None)
    if hasattr(head, "base_layer"):  # a peft LoRA wrapper around the head
        head_weight = head.base_layer.weight
    return head_weight is embed.weight


# --------------------------------------------------------------------------------------------
# Exports
# --------------------------------------------------------------------------------------------


def save_merged(
    base: Any,
    out_dir: Path,
    deltas: dict[str, torch.Tensor],
    tokenizer: Any = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Write a plain transformers model directory: base weights + LoRA deltas, never in place.

    `base` is the transformers model (possibly wrapped by peft; `.base_layer` names are
    unwrapped). `deltas` maps a module path (e.g. `model.layers.0.self_attn.q_proj`) to the
    weight delta to add, or a parameter's name (`model.layers.0.mlp.experts.down_proj`, a 3-D
    expert stack) to its delta. If the output head receives a delta while tied to the input
    embeddings, the export is untied: the head gets its own weight and the config says so.
    With `dtype`, the merged weights are then rounded to it (`compute/precision.py`).
    """
    from safetensors.torch import save_file

    head_name = head_attr(base)
    tied = is_tied(base)
    state: dict[str, torch.Tensor] = {}
    for key, tensor in base.state_dict().items():
        if "lora_" in key:
            continue
        state[unwrapped(key)] = tensor  # nested wrappers too (peft's ParamWrapper on experts)
    for path, delta in deltas.items():
        key = path if path in state else f"{path}.weight"  # a parameter's own name, or a module's
        state[key] = state[key] + delta.to(state[key].dtype)
    untie = tied and head_name in deltas
    if tied and not untie:
        state.pop(f"{head_name}.weight", None)
    config = base.config.to_dict()
    if untie:
        config["tie_word_embeddings"] = False
        if isinstance(config.get("text_config"), dict):
            config["text_config"]["tie_word_embeddings"] = False
    if dtype is not None:
        state = precision.cast(state, dtype, precision.kept_in_fp32(base, dtype))
        precision.name_dtype(config, dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {key: tensor.detach().to("cpu").contiguous().clone() for key, tensor in state.items()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str))
    generation = getattr(base, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)


def read_model_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of a (possibly sharded) safetensors model directory."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no .safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(str(file)))
    return weights


def read_weights_as(
    model: Any, model_dir: Path, trust_remote_code: bool
) -> dict[str, torch.Tensor]:
    """A full model directory's weights under `model`'s own parameter names (docs/semantics.md
    §16). This worker's exports store those names, as do most checkpoints. Others store a
    family's checkpoint names, which transformers converts as it loads (per-expert MoE weights
    fused into stacks, a composite's legacy prefixes): such a directory is loaded by
    transformers, as `model`'s class on the CPU, and refused when it lacks a weight or holds one
    of another shape. A tied head may be absent (it is read from the embedding)."""
    weights = read_model_weights(model_dir)
    head = f"{head_attr(model)}.weight"
    names = [name for name, _ in model.named_parameters()]
    if all(name in weights or name == head for name in names):
        return weights
    with COMPUTE_LOCK:  # a load swaps process-global state (the module docstring)
        try:
            loaded, info = type(model).from_pretrained(
                model_dir,
                dtype="auto",
                trust_remote_code=trust_remote_code,
                output_loading_info=True,
            )
        except (OSError, RuntimeError, ValueError) as exc:
            raise ValueError(f"{model_dir}: weights do not load as this model: {exc}") from None
    missing = sorted(info["missing_keys"])
    mismatched = sorted(k[0] if isinstance(k, tuple) else str(k) for k in info["mismatched_keys"])
    if missing or mismatched:
        raise ValueError(
            f"{model_dir}: weights do not match this model "
            f"(missing {missing[:3]}, of other shapes {mismatched[:3]})"
        )
    return {name: tensor.detach() for name, tensor in loaded.state_dict().items()}


def is_adapter_dir(path: Path) -> bool:
    return (path / "adapter_config.json").exists()


def env_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False")
