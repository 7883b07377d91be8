"""Typed settings of `trainer serve`: a TOML file plus a few command-line overrides.

Design notes: `docs/design/serving.md`.
"""

from __future__ import annotations

import ipaddress
import re
import sys
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from trainer.contract.generation import GeneratorOptions
from trainer.contract.options import DistributedOptions, EngineOptions
from trainer.contract.specs import ModelEntry, StrictSpec


class ServeConfig(StrictSpec):
    """Everything the HTTP worker needs; validated before any model is touched."""

    host: str = Field(default="127.0.0.1", description="interface to bind")
    port: int = Field(default=8321, ge=0, le=65535, description="TCP port (0 = any free)")
    storage: Path = Field(description="root of the SQLite catalogues, checkpoints and payloads")
    models: list[ModelEntry] = Field(
        default_factory=list, alias="model", description="the catalogue"
    )
    token_file: Path | None = Field(default=None, description="file holding the bearer token")
    keys_file: Path | None = Field(
        default=None, description="TOML file of users' API keys (sha256), admins and quotas"
    )
    no_auth: bool = Field(default=False, description="serve without a token (loopback only)")
    resource_file: Path | None = Field(default=None, description="JSON resource to preload")
    session_file: Path | None = Field(default=None, description="JSON session to preload")
    device: str | None = Field(default=None, description="torch device; default cuda if present")
    public_url: str | None = Field(
        default=None,
        description="base of signed URLs; default: the bound address, http://<host>:<port>",
    )
    signed_url_ttl_s: float = Field(default=3600.0, gt=0, description="life of signed URLs")
    op_inline_wait_s: float = Field(
        default=0.2, ge=0, description="how long an operation POST waits to answer COMPLETED"
    )
    session_create_wait_s: float = Field(
        default=60.0, ge=0, description="how long a session POST waits to answer RUNNING"
    )
    resource_create_wait_s: float = Field(
        default=60.0, ge=0, description="how long a resource POST waits for the model to load"
    )
    max_resources: int = Field(
        default=8, ge=1, description="live model resources (each holds its own copy of a model)"
    )
    max_sessions_per_resource: int = Field(
        default=64, ge=1, description="live sessions on one model resource"
    )
    max_body_bytes: int = Field(default=64 << 20, ge=1024, description="inline request bodies")
    max_payload_bytes: int = Field(
        default=1 << 30,
        ge=1024,
        description="uploaded payloads (the SDK allows 4.995 GiB; parsing one takes about 6x "
        "its size in the body parser's process, and ~1x in the worker)",
    )
    result_offload_bytes: int = Field(
        default=4 << 20, ge=1024, description="larger operation outputs go out by payload"
    )
    expiry_check_s: float = Field(default=5.0, gt=0, description="inactivity sweep period")
    shutdown_grace_s: float = Field(
        default=30.0, ge=0, description="on SIGTERM, how long the running operation may finish"
    )
    audit_max_bytes: int = Field(
        default=16 << 20,
        ge=1024,
        description="size past which <storage>/audit.jsonl rotates to audit.jsonl.1",
    )
    audit_keep: int = Field(
        default=4, ge=1, le=1000, description="rotated audit files kept (audit.jsonl.1 ... .N)"
    )
    metrics_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="serve /metrics without a key on this port too (0 or unset: off)",
    )
    metrics_host: str = Field(
        default="127.0.0.1", description="interface of the unauthenticated metrics port"
    )
    resume_roots: list[Path] = Field(
        default_factory=list,
        description="local directories besides `storage` that resume_from_hf_checkpoint may read",
    )
    engine: EngineOptions = Field(
        default_factory=EngineOptions, description="how every resource and session computes"
    )
    distributed: DistributedOptions = Field(
        default_factory=DistributedOptions, description="knobs that apply under torchrun"
    )
    generator: GeneratorOptions = Field(
        default_factory=GeneratorOptions,
        description="what serves samples (a model's own `generator` table overrides keys)",
    )

    @model_validator(mode="after")
    def _check(self) -> ServeConfig:
        names = [m.name for m in self.models]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"model: duplicate names {duplicates}")
        # each entry carries its effective generator options: the worker's, its own over them
        self.models = [
            m.model_copy(update={"generator": self.generator.over(m.generator)})
            for m in self.models
        ]
        return self

    def model(self, name: str) -> ModelEntry | None:
        return next((m for m in self.models if m.name == name), None)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def load_toml(path: Path) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    with path.open("rb") as handle:
        data: dict[str, Any] = tomllib.load(handle)
    return data


# the `ModelEntry` keys a `--model` flag may set after its location (`,KEY=VALUE`)
MODEL_FLAG_KEYS = (
    "max_lora_rank",
    "max_seq_length",
    "max_batch_size",
    "max_tokens_per_call",
    "dtype",
    "tokenizer",
    "attn_implementation",
    "revision",
    "trust_remote_code",
)
_KEY = re.compile(r"[a-z_]+")


def parse_model_flag(value: str) -> tuple[str, str, dict[str, str]]:
    """`NAME=PATH_OR_HUB_ID[,KEY=VALUE...]` -> (name, location, {key: value}).

    The trailing `,KEY=VALUE` parts set that entry's `ModelEntry` keys (`MODEL_FLAG_KEYS`:
    `--model qwen=Qwen/Qwen3-8B,max_lora_rank=256`); the values are validated with the rest
    of the catalogue. A comma not followed by `KEY=` stays in the location."""
    name, sep, rest = value.partition("=")
    parts = rest.split(",")
    keys: dict[str, str] = {}
    while len(parts) > 1:
        key, eq, item = parts[-1].partition("=")
        if not eq or not _KEY.fullmatch(key.strip()):
            break
        key = key.strip()
        if key not in MODEL_FLAG_KEYS:
            raise ValueError(
                f"--model {value!r}: {key!r} is not a model key; one of {list(MODEL_FLAG_KEYS)}"
            )
        if key in keys:
            raise ValueError(f"--model {value!r}: {key} is given twice")
        keys[key] = item.strip()
        parts.pop()
    location = ",".join(parts)
    if not sep or not name.strip() or not location.strip():
        raise ValueError(f"--model expects NAME=PATH_OR_HUB_ID[,KEY=VALUE...], got {value!r}")
    return name.strip(), location.strip(), dict(reversed(keys.items()))


def overlay_models(base: list[dict[str, Any]], flags: list[str]) -> list[dict[str, Any]]:
    """Command-line models override the location (and the keys they give) of same-named
    config models, else append."""
    merged = [dict(m) for m in base]
    for flag in flags:
        name, location, keys = parse_model_flag(flag)
        existing = next((m for m in merged if m.get("name") == name), None)
        if existing is not None:
            existing.update(location=location, **keys)
        else:
            merged.append({"name": name, "location": location, **keys})
    return merged
