"""The typed recipe: one TOML file in `configs/` holds every knob of a run.

Validated once when loaded, so a typo or an out-of-range value fails before a model is built,
with a message that names the field. `trainer demo --steps N --device DEV` override
`loop.steps` and `device`; nothing else is a flag.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainer.contract.values import DEFAULT_MAX_LORA_RANK
from trainer.rl.tasks import BOS, DIGITS_VOCAB, EOS, PAD
from trainer.tiny import TinySpec


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelConfig(Section):
    """Which base model the worker serves: a tiny one built from a config, or a real one."""

    source: Literal["tiny", "pretrained"] = Field(default="tiny", description="build tiny or load")
    name: str = Field(
        default="tiny-digits", min_length=1, description="catalogue name (base_model)"
    )
    location: str | None = Field(
        default=None, description="pretrained: hub id, hf://id or local dir"
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="dtype"
    )
    max_seq_length: int = Field(default=256, ge=8, description="tokens per sample")
    max_batch_size: int = Field(default=1024, ge=1, description="samples per call")
    max_lora_rank: int = Field(
        default=DEFAULT_MAX_LORA_RANK, ge=1, description="largest LoRA rank allowed"
    )
    # tiny models only
    arch: Literal["qwen3", "llama"] = Field(default="qwen3", description="tiny: architecture")
    hidden_size: int = Field(default=64, ge=8, description="tiny: width")
    num_layers: int = Field(default=2, ge=1, description="tiny: decoder layers")
    num_heads: int = Field(default=4, ge=1, description="tiny: attention heads")
    num_kv_heads: int = Field(default=2, ge=1, description="tiny: key/value heads")
    intermediate_size: int = Field(default=128, ge=8, description="tiny: MLP width")
    init_seed: int = Field(default=0, description="tiny: seed of the random weights")

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.source == "pretrained" and not self.location:
            raise ValueError("model.location is required when model.source = 'pretrained'")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(
                "model: hidden_size % num_heads and num_heads % num_kv_heads must be 0"
            )
        return self

    def tiny_spec(self) -> TinySpec:
        """The tiny model of this config (`source = "tiny"`): the digits task's 16-token
        vocabulary, tied embeddings for Qwen3 and untied for Llama."""
        return TinySpec(
            arch=self.arch,
            vocab=DIGITS_VOCAB,
            hidden=self.hidden_size,
            intermediate=self.intermediate_size,
            layers=self.num_layers,
            heads=self.num_heads,
            kv_heads=self.num_kv_heads,
            tied=self.arch == "qwen3",
            max_positions=self.max_seq_length,
            bos=BOS,
            eos=EOS,
            pad=PAD,
        )


class ResourceConfig(Section):
    """The model resource and the session's trainable part."""

    lora: bool = Field(default=False, description="LoRA adapter (true) or full weights (false)")
    lora_rank: int = Field(default=32, ge=1, description="LoRA rank")
    lora_alpha: int = Field(default=64, ge=1, description="LoRA alpha")
    train_unembed: bool = Field(default=True, description="also a LoRA on the output head")
    lora_seed: int | None = Field(default=None, description="LoRA init seed (default: run seed)")
    optimizer: Literal["adam", "muon"] = Field(
        default="adam", description="the resource's optimizer (Muon: docs/semantics.md §10)"
    )
    muon_scaling_strategy: Literal[
        "MUON_SCALING_STRATEGY_MATCH_ADAM", "MUON_SCALING_STRATEGY_ORIGINAL"
    ] = Field(default="MUON_SCALING_STRATEGY_MATCH_ADAM", description="Muon's update scale")

    def optimizer_config(self) -> dict[str, Any]:
        """The resource's `optimizer_config`."""
        if self.optimizer == "muon":
            return {"muon": {"scaling_strategy": self.muon_scaling_strategy}}
        return {"adam": {}}


class TaskConfig(Section):
    """The built-in verifiable task; prompts are generated on the fly."""

    name: Literal["digits", "arithmetic"] = Field(default="digits", description="task")
    mode: Literal["copy", "reverse"] = Field(default="copy", description="digits: copy or reverse")
    length: int = Field(default=6, ge=1, le=32, description="digits: string length")
    max_operand: int = Field(
        default=99, ge=1, description="arithmetic: operands in [0, max_operand]"
    )
    operations: list[Literal["+", "-", "*"]] = Field(
        default_factory=lambda: ["+", "-"],  # type: ignore[arg-type]
        description="arithmetic: operators",
    )
    eval_prompts: int = Field(
        default=64, ge=0, description="greedy eval prompts at the end (0: off)"
    )


class LoopConfig(Section):
    """The training loop: one step = sample → reward → advantages → train → sync."""

    objective: Literal["grpo", "sft"] = Field(
        default="grpo", description="RL (GRPO) or cross entropy"
    )
    mode: Literal["on_policy", "off_policy"] = Field(
        default="on_policy",
        description="SYNCHRONOUS sync, or 1-step off-policy with BACKGROUND_PUBLISH",
    )
    steps: int = Field(default=200, ge=1, description="optimizer steps")
    prompts_per_step: int = Field(default=16, ge=1, description="prompts per batch")
    group_size: int = Field(default=8, ge=1, description="completions per prompt (G)")
    learning_rate: float = Field(default=3e-3, gt=0, description="AdamW learning rate")
    lr_warmup_steps: int = Field(default=0, ge=0, description="linear warm-up steps")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW decoupled weight decay")
    beta2: float = Field(default=0.95, ge=0, lt=1, description="AdamW beta2")
    grad_clip_norm: float = Field(default=1.0, ge=0, description="global-norm clip (0: off)")
    muon_momentum: float = Field(default=0.95, ge=0, lt=1, description="Muon momentum")
    scale_by_std: bool = Field(default=True, description="divide advantages by the group's std")
    per_token_advantages: bool = Field(
        default=True,
        description="tasks scored per token (digits): each position normalised across the "
        "group on its own; other tasks fall back to one advantage per completion",
    )
    log_every: int = Field(default=1, ge=1, description="print one line every N steps")


class SamplingConfig(Section):
    temperature: float = Field(default=1.0, gt=0, description="sampling temperature")
    top_p: float = Field(default=1.0, gt=0, le=1, description="nucleus sampling")
    max_tokens: int | None = Field(default=None, ge=1, description="default: what the task needs")


class GrpoConfig(Section):
    clip_low_threshold: float = Field(default=0.8, ge=0, le=1, description="lower ratio bound")
    clip_high_threshold: float = Field(default=1.28, ge=1, description="upper ratio bound")
    agg_type: Literal["TOKEN_MEAN", "SEQUENCE_MEAN", "FIXED_HORIZON"] = Field(
        default="TOKEN_MEAN", description="how per-token losses are averaged"
    )
    ratio_type: Literal["TOKEN", "SEQUENCE"] = Field(
        default="TOKEN", description="token or GSPO ratio"
    )


class WandbConfig(Section):
    """Set `project` to log to Weights & Biases (`WANDB_MODE=offline` works without a key)."""

    project: str | None = None
    entity: str | None = None
    group: str | None = None
    run_name: str | None = None


class Recipe(Section):
    """A whole run. The defaults ARE the demo recipe (`configs/demo.toml` spells them out)."""

    seed: int = Field(default=0, description="seed of prompts, sampling and LoRA init")
    device: str | None = Field(default=None, description="worker device (default cuda if present)")
    model: ModelConfig = Field(default_factory=ModelConfig)
    resource: ResourceConfig = Field(default_factory=ResourceConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    loop: LoopConfig = Field(default_factory=LoopConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    grpo: GrpoConfig = Field(default_factory=GrpoConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)

    @model_validator(mode="after")
    def _check(self) -> Recipe:
        if self.task.name == "digits" and self.model.source != "tiny":
            raise ValueError("task.name = 'digits' needs model.source = 'tiny' (its own vocab)")
        if self.task.name == "arithmetic" and self.model.source == "tiny":
            raise ValueError("task.name = 'arithmetic' needs a model with a tokenizer")
        if self.loop.objective == "sft" and self.loop.mode == "off_policy":
            raise ValueError("loop.mode = 'off_policy' only applies to objective = 'grpo'")
        return self


def load_recipe(path: Path | None, overrides: dict[str, Any] | None = None) -> Recipe:
    """Read a TOML recipe (or the defaults), apply `{"loop.steps": 5, ...}`, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # pragma: no cover
            import tomli as tomllib
        with path.open("rb") as handle:
            data = tomllib.load(handle)
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return Recipe.model_validate(data)
