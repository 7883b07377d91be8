"""Adapter exports: a LoRA adapter alone, for a user to take away, in PEFT's naming or in
Tinker's, and optionally encrypted to age recipients.

Tinker names the LoRA on the output head `model.unembed_tokens` (its adapter key
`base_model.model.model.unembed_tokens.lora_A.weight`), where PEFT names the module `lm_head`;
tinker-cookbook's `weights.build_hf_model` maps `unembed_tokens` to `lm_head`, or to
`model.embed_tokens` on a tied model, and finds nothing to merge a `lm_head` key into when the
base model's files have no `lm_head.weight` (every tied model). Every other key is the same in
both namings. `to_tinker` and `from_tinker` translate between them; nothing else changes (the
tensors, rank, alpha).

Encryption uses age (`pyrage`, the Rust `age` implementation): each file is encrypted in
memory and written as `<name>.age`, so the plaintext of an encrypted export never reaches the
disk. Recipients are X25519 (`age1...`) or SSH public keys, as the Tinker SDK documents.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pyrage
import torch
from safetensors.torch import save, save_file

from trainer.checkpoint.store import CheckpointCorrupt, CheckpointStore

AGE_SUFFIX = ".age"
MAX_RECIPIENTS = 10  # the Tinker SDK's documented limit
PEFT_HEAD = "base_model.model.lm_head."
TINKER_HEAD = "base_model.model.model.unembed_tokens."
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
ENCRYPTED_EXPORT = (
    "is an age-encrypted export: its files are for download only, and the worker holds no "
    "identity to read them (decrypt them where the identity is, with `age -d`)"
)

_pyrage: Any = pyrage  # the extension module ships no type information


@dataclass(frozen=True)
class AdapterExport:
    """What an adapter export writes: the naming of its keys and the age recipients its
    files are encrypted to (none: plain files)."""

    naming: Literal["peft", "tinker"] = "tinker"
    age_recipients: tuple[str, ...] = ()

    @property
    def encrypted(self) -> bool:
        return bool(self.age_recipients)

    def meta(self) -> dict[str, Any]:
        """What the checkpoint's manifest records of it (`meta.export`)."""
        return {"naming": self.naming, "encrypted": self.encrypted}


def recipient(text: str) -> Any:
    """An age recipient parsed from its text; ValueError otherwise. The message never repeats
    the text: a user may paste a secret identity where a recipient goes."""
    if text.startswith("AGE-SECRET-KEY-"):
        raise ValueError(
            "this is an age identity (a secret key), not a recipient: pass its public key "
            "(`age-keygen -y`)"
        )
    try:
        if text.startswith("age1"):
            return _pyrage.x25519.Recipient.from_str(text)
        if text.startswith("ssh-"):
            return _pyrage.ssh.Recipient.from_str(text)
    except _pyrage.RecipientError as exc:
        raise ValueError(f"not a valid age recipient ({exc})") from None
    raise ValueError(
        "not an age recipient: expected an X25519 recipient (age1...) or an SSH public key "
        "(ssh-ed25519 ... or ssh-rsa ...)"
    )


def to_tinker(
    tensors: dict[str, torch.Tensor], config: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A PEFT adapter (keys, adapter_config) in Tinker's naming: the head's LoRA under
    `model.unembed_tokens`."""
    renamed = {_swap(key, PEFT_HEAD, TINKER_HEAD): value for key, value in tensors.items()}
    out = dict(config)
    targets = config.get("target_modules")
    if isinstance(targets, list):
        out["target_modules"] = sorted("unembed_tokens" if t == "lm_head" else t for t in targets)
    return renamed, out


def from_tinker(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Adapter tensors in PEFT's naming, from either naming (the inverse of `to_tinker`)."""
    return {_swap(key, TINKER_HEAD, PEFT_HEAD): value for key, value in tensors.items()}


def _swap(key: str, old: str, new: str) -> str:
    return new + key[len(old) :] if key.startswith(old) else key


def write_adapter(
    directory: Path,
    tensors: dict[str, torch.Tensor],
    config: dict[str, Any],
    export: AdapterExport,
) -> None:
    """`adapter_config.json` and `adapter_model.safetensors` in `directory` (created), in the
    export's naming; encrypted, each as `<name>.age` from memory, when it has recipients."""
    if export.naming == "tinker":
        tensors, config = to_tinker(tensors, config)
    directory.mkdir(parents=True)
    config_bytes = json.dumps(config, indent=2).encode()
    if not export.encrypted:
        save_file(tensors, str(directory / ADAPTER_FILES[1]), metadata={"format": "pt"})
        (directory / ADAPTER_FILES[0]).write_bytes(config_bytes)
        return
    recipients = [recipient(text) for text in export.age_recipients]
    files = {
        ADAPTER_FILES[0]: config_bytes,
        ADAPTER_FILES[1]: save(tensors, metadata={"format": "pt"}),
    }
    for name, plain in files.items():
        sealed = _pyrage.encrypt(plain, recipients)
        with open(directory / f"{name}{AGE_SUFFIX}", "xb") as fh:
            fh.write(sealed)


def export_of(manifest: dict[str, Any]) -> dict[str, Any] | None:
    """`meta.export` of a checkpoint's manifest: present on adapter exports only."""
    meta = manifest.get("meta")
    found = meta.get("export") if isinstance(meta, dict) else None
    return found if isinstance(found, dict) else None


def is_encrypted(manifest: dict[str, Any]) -> bool:
    export = export_of(manifest)
    return bool(export and export.get("encrypted"))


def stored_export(store: CheckpointStore, checkpoint_id: str) -> dict[str, Any] | None:
    """`export_of` a catalogued checkpoint; None when it is no export, or when its manifest
    cannot be read (whoever opens it next names that)."""
    try:
        return export_of(store.manifest(checkpoint_id))
    except (KeyError, CheckpointCorrupt):
        return None


def stored_encrypted(store: CheckpointStore, checkpoint_id: str) -> bool:
    return bool((stored_export(store, checkpoint_id) or {}).get("encrypted"))
