"""The engine's knobs, in one place: the `[engine]` and `[distributed]` tables of the TOML
config (`trainer serve --config`), the `--engine-*` / `--distributed-*` flags, and what every
resource and session runs with, in one process or under torchrun.

Each field's default is the one the engine uses when nothing is set; `configs/serve.example.toml`
lists them all (a test checks it). Two legacy environment variables still fill a key that
neither the TOML nor the command line sets (`ENV_FALLBACKS`).
"""

from __future__ import annotations

import argparse
import json
import os
import types
import typing
from typing import Any, Literal

from pydantic import Field

from trainer.contract.generation import GeneratorOptions
from trainer.contract.specs import StrictSpec

ROW_TOKENS = 2048
TOKEN_BUDGET = 16384
CHUNK_TOKENS = 1024
COLLECTIVE_TIMEOUT_S = 600.0
MERGE_WINDOW_MS = 2.0
MERGE_MAX_TOKENS = 16384
DECODE_STEPS_PER_TURN = 16
ROUTES_TTL_S = 7200.0
ROUTES_MAX_BYTES = 1 << 30
STABILITY_TTL_S = 86400.0
STABILITY_MAX_BYTES = 1 << 30

LogprobBackend = Literal["ours", "liger"]


class EngineOptions(StrictSpec):
    """How a resource's sessions lay out and compute a call (the `[engine]` table)."""

    row_tokens: int = Field(default=ROW_TOKENS, ge=1, description="packing: tokens per packed row")
    token_budget: int = Field(
        default=TOKEN_BUDGET, ge=1, description="tokens per micro-batch (one forward-backward)"
    )
    chunk_tokens: int = Field(
        default=CHUNK_TOKENS, ge=1, description="tokens per chunk of the logprob head"
    )
    activation_checkpointing: bool = Field(
        default=False, description="recompute decoder layers in the backward"
    )
    master_weights: bool = Field(
        default=True,
        description="16-bit full weights step through fp32 master copies (AdamW and Muon)",
    )
    logprob_backend: LogprobBackend = Field(
        default="ours",
        description="`liger`: liger-kernel's fused head on CUDA where it applies, else ours",
    )
    merge: bool = Field(
        default=True,
        description="run concurrent LoRA sessions' forward(-backward) calls as one shared pass",
    )
    merge_window_ms: float = Field(
        default=MERGE_WINDOW_MS, ge=0, description="how long a shared pass waits for more calls"
    )
    merge_max_tokens: int = Field(
        default=MERGE_MAX_TOKENS, ge=1, description="tokens per shared pass, at most"
    )
    batch_samples: bool = Field(
        default=True,
        description="concurrent samples of a LoRA resource's sessions as one generation batch",
    )
    decode_steps_per_turn: int = Field(
        default=DECODE_STEPS_PER_TURN,
        ge=0,
        description="a sample lets waiting operations run every N decode steps (0: never)",
    )
    routes_ttl_s: float = Field(
        default=ROUTES_TTL_S, gt=0, description="MoE routing-replay keys expire after this long"
    )
    routes_max_bytes: int = Field(
        default=ROUTES_MAX_BYTES,
        ge=0,
        description="bytes of routing-replay key files under <storage>/routes (oldest dropped)",
    )
    stability_ttl_s: float = Field(
        default=STABILITY_TTL_S,
        gt=0,
        description="Tinker stability records (stable_reinforce) expire this long after last use",
    )
    stability_max_bytes: int = Field(
        default=STABILITY_MAX_BYTES,
        ge=0,
        description="bytes of Tinker stability records kept (least recently used dropped)",
    )


class DistributedOptions(StrictSpec):
    """Knobs that apply under torchrun only (the `[distributed]` table)."""

    cpu_offload: bool = Field(
        default=False, description="FSDP2 CPU offload of parameters, gradients and AdamW state"
    )
    collective_timeout_s: float = Field(
        default=COLLECTIVE_TIMEOUT_S,
        gt=0,
        description="bound on every collective of an operation (a dead or stuck rank)",
    )


# (table, key) -> environment variable read when neither the TOML nor a flag sets the key
ENV_FALLBACKS: dict[tuple[str, str], str] = {
    ("engine", "logprob_backend"): "TRAINER_LOGPROBS_BACKEND",
    ("distributed", "collective_timeout_s"): "TRAINER_DIST_TIMEOUT_S",
}

SECTIONS: dict[str, type[StrictSpec]] = {
    "engine": EngineOptions,
    "distributed": DistributedOptions,
    "generator": GeneratorOptions,
}


def fill_from_env(data: dict[str, Any], environ: Any = None) -> dict[str, Any]:
    """`data` (the config's top-level dict) with each unset `ENV_FALLBACKS` key taken from the
    environment, when there."""
    env = os.environ if environ is None else environ
    for (section, key), name in ENV_FALLBACKS.items():
        value = env.get(name)
        table = data.get(section)
        if value in (None, "") or (table is not None and not isinstance(table, dict)):
            continue
        if table is None or key not in table:
            data[section] = {**(table or {}), key: value}
    return data


def _flag(section: str, key: str) -> str:
    return f"--{section}-{key.replace('_', '-')}"


def add_option_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per key of each options table (`SECTIONS`), typed from the field; unset flags
    stay None so that the TOML value (or the default) applies."""
    for section, model in SECTIONS.items():
        group = parser.add_argument_group(f"[{section}]", (model.__doc__ or "").strip())
        for key, info in model.model_fields.items():
            dest = f"{section}__{key}"
            default = f"default {info.default}"
            help_text = f"{info.description} ({default})"
            if info.annotation is bool:
                group.add_argument(
                    _flag(section, key),
                    dest=dest,
                    action=argparse.BooleanOptionalAction,
                    default=None,
                    help=help_text,
                )
                continue
            choices = typing.get_args(info.annotation) if _is_literal(info.annotation) else None
            kind: Any = str if choices else _flag_type(info.annotation)
            group.add_argument(
                _flag(section, key),
                dest=dest,
                type=kind,
                choices=choices,
                metavar=None if choices else key.upper(),
                help=help_text,
            )


def _flag_type(annotation: Any) -> Any:
    """How a flag's text becomes the field's value: JSON for a table (`extra_engine_args`),
    the type itself for a scalar, and the inner type of an optional one."""
    origin = typing.get_origin(annotation)
    if annotation is dict or origin is dict:
        return json.loads
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _flag_type(inner[0]) if len(inner) == 1 else str
    return annotation


def _is_literal(annotation: Any) -> bool:
    return typing.get_origin(annotation) is typing.Literal


def option_overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The options tables given on the command line: {section: {key: value}}."""
    tables: dict[str, dict[str, Any]] = {}
    for section, model in SECTIONS.items():
        for key in model.model_fields:
            value = getattr(args, f"{section}__{key}", None)
            if value is not None:
                tables.setdefault(section, {})[key] = value
    return tables


def overlay_tables(data: dict[str, Any], tables: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Command-line keys laid over the TOML's tables (a non-table TOML value is left for the
    validation to refuse)."""
    for section, values in tables.items():
        table = data.get(section, {})
        data[section] = {**table, **values} if isinstance(table, dict) else table
    return data
