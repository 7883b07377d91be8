"""Loading a base model, choosing LoRA targets, and exporting weights without touching the base.

A location is a local directory, a hub id (`org/name`), or `hf://org/name`. Hub access goes
through transformers / huggingface_hub, so `HF_HUB_OFFLINE`, `HF_HOME` and the cache are
respected. `trust_remote_code` is only ever passed through from the catalogue entry.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from trainer.specs import LoraConfig, ModelEntry

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def load_base_model(entry: ModelEntry, device: torch.device) -> tuple[Any, Any]:
    """Load the base model (and its tokenizer, when it has one) for a catalogue entry."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    source = str(local_dir(entry.location, entry.revision))
    dtype = resolve_dtype(entry.dtype, device)
    attn = "sdpa"
    if device.type == "cuda" and _has_flash_attn():
        attn = "flash_attention_2"
    model = AutoModelForCausalLM.from_pretrained(
        source,
        dtype=dtype,
        trust_remote_code=entry.trust_remote_code,
        attn_implementation=attn,
    )
    model.to(device)  # type: ignore[arg-type]
    if attn == "sdpa":
        from trainer.batch import use_packed_sdpa

        use_packed_sdpa(model)  # exact varlen attention for packed samples, plain sdpa otherwise
    model.requires_grad_(False)
    model.eval()
    tokenizer = None
    if any(Path(source, name).exists() for name in ("tokenizer.json", "tokenizer_config.json")):
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=entry.trust_remote_code)
    log.info("loaded %s from %s (%s, %s, attn=%s)", entry.name, source, dtype, device, attn)
    return model, tokenizer


def _has_flash_attn() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def lora_target_modules(model: Any, train_unembed: bool) -> list[str]:
    """Every linear layer of the decoder (leaf names), plus the output head with train_unembed.

    Like peft's "all-linear" but explicit, so the head can be added as a real LoRA target
    (not `modules_to_save`, which inference servers reject).
    """
    decoder = model.get_decoder()
    names = sorted(
        {name.rsplit(".", 1)[-1] for name, mod in decoder.named_modules() if _is_linear(mod)}
    )
    if train_unembed:
        head_name = _head_attr(model)
        names.append(head_name)
    return names


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Linear"


def _head_attr(model: Any) -> str:
    head = model.get_output_embeddings()
    for name, module in model.named_children():
        if module is head:
            return name
    raise ValueError("the model's output head is not a direct child module")


def peft_lora_config(model: Any, config: LoraConfig) -> Any:
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=lora_target_modules(model, config.train_unembed),
        bias="none",
        task_type="CAUSAL_LM",
    )


def is_tied(model: Any) -> bool:
    head = model.get_output_embeddings()
    embed = model.get_input_embeddings()
    head_weight = getattr(head, "weight", None)
    if hasattr(head, "base_layer"):  # a peft LoRA wrapper around the head
        head_weight = head.base_layer.weight
    return head_weight is embed.weight


@contextlib.contextmanager
def quiet_peft_warnings() -> Iterator[None]:
    """peft warns about LoRA on a tied head; we never merge in place, so the warning is moot."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        warnings.filterwarnings("ignore", message=".*should not be contained in the prefix.*")
        warnings.filterwarnings("ignore", message=".*was active which is now deleted.*")
        yield


# --------------------------------------------------------------------------------------------
# Exports
# --------------------------------------------------------------------------------------------


def save_merged(
    base: Any,
    out_dir: Path,
    deltas: dict[str, torch.Tensor],
    tokenizer: Any = None,
) -> None:
    """Write a plain transformers model directory: base weights + LoRA deltas, never in place.

    `base` is the transformers model (possibly wrapped by peft; `.base_layer` names are
    unwrapped). `deltas` maps a module path (e.g. `model.layers.0.self_attn.q_proj`) to the
    weight delta to add. If the output head receives a delta while tied to the input
    embeddings, the export is untied: the head gets its own weight and the config says so.
    """
    from safetensors.torch import save_file

    head_name = _head_attr(base)
    tied = is_tied(base)
    state: dict[str, torch.Tensor] = {}
    for key, tensor in base.state_dict().items():
        if "lora_" in key:
            continue
        state[key.replace(".base_layer.", ".")] = tensor
    for path, delta in deltas.items():
        key = f"{path}.weight"
        state[key] = state[key] + delta.to(state[key].dtype)
    untie = tied and head_name in deltas
    if tied and not untie:
        state.pop(f"{head_name}.weight", None)
    config = base.config.to_dict()
    if untie:
        config["tie_word_embeddings"] = False
        if isinstance(config.get("text_config"), dict):
            config["text_config"]["tie_word_embeddings"] = False
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


def is_adapter_dir(path: Path) -> bool:
    return (path / "adapter_config.json").exists()


def env_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False")
