"""`base_weights_ref`: a full-weight resource that trains from the merged model of one of this
worker's inference checkpoints instead of its base model's own weights (docs/semantics.md §9, §16).

The ref is an inference checkpoint id. Its `merged/` variant must hold a model with the
resource's architecture: the same `model_type` and the same shapes (`SHAPE_KEYS`, at the top
level and in `text_config`). The HTTP layer checks this when the resource is created
(`check_ref`, a 400 naming the field); the loader opens the checkpoint again, verifying every
file's sha256, and compares against the loaded model (`merged_dir`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainer.checkpoint.store import INFERENCE, MERGED_DIR, CheckpointCorrupt

FIELD = "base_weights_ref"

# config keys that fix the tensors' names and shapes (absent keys must be absent on both sides)
SHAPE_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "attention_bias",
    "mlp_bias",
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "n_shared_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "decoder_sparse_step",
    "mlp_only_layers",
    "first_k_dense_replace",
)


class RefError(ValueError):
    """A `base_weights_ref` that cannot be used; the message names the field."""

    def __init__(self, message: str) -> None:
        super().__init__(f"{FIELD}: {message}")


def check_ref(store: Any, ref: str, lora: bool, base_model: str, base_config: Any) -> Path:
    """The merged-model directory of inference checkpoint `ref`, after the cheap checks (the
    catalogue record, the manifest's merged files and their sizes, the architecture against
    `base_config`: the resource's model config as a dict, or None when it cannot be read
    yet). RefError otherwise."""
    if lora:
        raise RefError(
            "a LoRA resource trains adapters on its base model's own weights; "
            "base_weights_ref needs lora_enabled false (a full-weight resource)"
        )
    record = store.get(ref)
    if record is None:
        raise RefError(f"no checkpoint {shown_ref(ref)} on this worker")
    if record.type != INFERENCE:
        raise RefError(
            f"checkpoint {ref} is a training checkpoint; name an inference checkpoint "
            "(its merged model is trained in place of the base model's weights)"
        )
    try:
        store.variant_files(ref, "MERGED")
    except KeyError:
        raise RefError(f"inference checkpoint {ref} has no merged model") from None
    except CheckpointCorrupt as exc:
        raise RefError(str(exc)) from None
    directory = Path(record.path) / MERGED_DIR
    if base_config is not None:
        check_architecture(ref, read_config(directory), base_model, base_config)
    return directory


def merged_dir(store: Any, ref: str, base_model: str, model_config: dict[str, Any]) -> Path:
    """For the loader: `check_ref`'s directory, with every file's sha256 verified (`open`)
    and the architecture compared against the loaded model's config."""
    try:
        record, _ = store.open(ref)
    except KeyError:
        raise RefError(f"no checkpoint {shown_ref(ref)} on this worker") from None
    except CheckpointCorrupt as exc:
        raise RefError(str(exc)) from None
    if record.type != INFERENCE:
        raise RefError(f"checkpoint {ref} is a training checkpoint, not an inference one")
    directory = Path(record.path) / MERGED_DIR
    check_architecture(ref, read_config(directory), base_model, model_config)
    return directory


def cached_config(location: str, revision: str | None) -> dict[str, Any] | None:
    """A catalogue entry's config.json when it is on this machine (a local directory or the
    hub cache), without any download; None otherwise."""
    path = Path(location).expanduser()
    file: Any = path / "config.json"
    if not path.is_dir():
        from huggingface_hub import try_to_load_from_cache

        try:
            file = try_to_load_from_cache(
                location.removeprefix("hf://"), "config.json", revision=revision
            )
        except Exception:  # not a hub id either
            return None
        if not isinstance(file, str):
            return None
    try:
        config: dict[str, Any] = json.loads(Path(file).read_text())
    except (OSError, ValueError):
        return None
    return config


def read_config(directory: Path) -> dict[str, Any]:
    try:
        config: dict[str, Any] = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise RefError(f"cannot read the merged model's config.json: {exc}") from None
    return config


def is_tied(config: dict[str, Any]) -> bool:
    """Whether a model config ties its output head to the input embeddings."""
    text = config.get("text_config")
    tied = config.get("tie_word_embeddings")
    if tied is None and isinstance(text, dict):
        tied = text.get("tie_word_embeddings")
    return bool(tied)


def check_architecture(
    ref: str, ours: dict[str, Any], base_model: str, theirs: dict[str, Any]
) -> None:
    """RefError naming the first shape key on which the two configs differ (both read
    through their transformers config class first, so that defaults count on both sides)."""
    ours, theirs = _complete(ours), _complete(theirs)
    for scope in ("", "text_config"):
        a = ours.get(scope, {}) if scope else ours
        b = theirs.get(scope, {}) if scope else theirs
        if not isinstance(a, dict) or not isinstance(b, dict):
            raise RefError(_mismatch(ref, base_model, scope or "config", a, b))
        for key in SHAPE_KEYS:
            if _norm(a.get(key)) != _norm(b.get(key)):
                name = f"{scope}.{key}" if scope else key
                raise RefError(_mismatch(ref, base_model, name, a.get(key), b.get(key)))


def _complete(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with its class's defaults filled in (as it is when transformers has no
    class for its `model_type`, e.g. remote code)."""
    from transformers import AutoConfig

    try:
        full: dict[str, Any] = AutoConfig.for_model(**config).to_dict()
    except Exception:  # an unknown model_type: compare the raw keys
        return config
    return full


def shown_ref(ref: str) -> str:
    return repr(ref) if len(ref) <= 200 else f"{ref[:200]!r}... ({len(ref)} characters)"


def _norm(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _mismatch(ref: str, base_model: str, key: str, ours: Any, theirs: Any) -> str:
    return (
        f"checkpoint {ref} holds a model whose architecture does not match base_model "
        f"{base_model!r}: {key} is {ours!r} there and {theirs!r} here"
    )
