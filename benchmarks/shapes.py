"""Qwen3-shaped random models and mixed-length batches, built from plain parameters.

Every model has Qwen3's vocabulary (151,936) and tied embeddings unless a row says otherwise;
the hidden size and depth are small so that a 2-core CPU runs each row in seconds. Weights are
random (seeded), nothing is downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from trainer import tiny
from trainer.tiny import TinySpec

QWEN3_VOCAB = 151_936


# What a row's shape is named by (its JSON, its model directory); the rest is fixed.
SHAPE_FIELDS = (
    "vocab",
    "hidden",
    "intermediate",
    "layers",
    "heads",
    "kv_heads",
    "head_dim",
    "tied",
)


@dataclass(frozen=True)
class ModelShape(TinySpec):
    """A Qwen3-shaped `trainer.tiny` model with the benchmarks' defaults (bos 0, eos 1, pad 0;
    32,768 positions)."""

    vocab: int = QWEN3_VOCAB
    intermediate: int = 192
    head_dim: int = 16
    max_positions: int = 32768

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in SHAPE_FIELDS}

    def describe(self) -> str:
        tie = "tied" if self.tied else "untied"
        return (
            f"V={self.vocab:,} H={self.hidden} L={self.layers} I={self.intermediate} "
            f"heads={self.heads}/{self.kv_heads}x{self.head_dim} {tie}"
        )

    def params(self) -> dict[str, int]:
        """Parameter counts: `embed`, `head` (0 when tied), `decoder` (per model)."""
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        attn = self.hidden * (q + 2 * kv) + q * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        decoder = self.layers * (attn + mlp)
        embed = self.vocab * self.hidden
        return {"embed": embed, "head": 0 if self.tied else embed, "decoder": decoder}


def shape_from(params: dict[str, Any]) -> ModelShape:
    return ModelShape(**params["shape"])


def qwen3_config(shape: ModelShape, **extra: Any) -> Any:
    """A transformers `Qwen3Config` of this shape, with no special token ids."""
    return tiny.hf_config(replace(shape, bos=None, eos=None, pad=None), **extra)


def build_model(shape: ModelShape, seed: int = 0, dtype: torch.dtype = torch.float32) -> Any:
    return tiny.build_model(shape, seed, dtype)


def save_model(shape: ModelShape, out_dir: Path, seed: int = 0) -> Path:
    """A random model saved the way `trainer.compute.model` loads it (safetensors + config)."""
    if (out_dir / "config.json").exists():
        return out_dir
    return tiny.save_model(shape, out_dir, seed, torch.float32)


@dataclass
class RLBatch:
    """B prompt + completion samples (token ids), and one advantage per sample."""

    prompts: list[list[int]]
    completions: list[list[int]]
    advantages_B: list[float]

    @property
    def num_tokens(self) -> int:
        return sum(len(p) + len(c) for p, c in zip(self.prompts, self.completions))


def rl_batch(
    seed: int,
    n: int,
    prompt_range: tuple[int, int],
    completion_range: tuple[int, int],
    vocab: int,
) -> RLBatch:
    gen = torch.Generator().manual_seed(seed)

    def draw(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (), generator=gen))

    prompts, completions = [], []
    for _ in range(n):
        p, c = draw(*prompt_range), draw(*completion_range)
        prompts.append(torch.randint(2, vocab, (p,), generator=gen).tolist())
        completions.append(torch.randint(2, vocab, (c,), generator=gen).tolist())
    advantages = torch.randn(n, generator=gen).tolist()
    return RLBatch(prompts=prompts, completions=completions, advantages_B=advantages)


def old_logprobs(seed: int, current: list[list[float]], scale: float = 0.1) -> list[list[float]]:
    """Sampler logprobs near the current ones, so that some ratios clip and some do not."""
    gen = torch.Generator().manual_seed(seed + 1)
    return [
        (torch.tensor(c) + scale * torch.randn(len(c), generator=gen)).tolist() for c in current
    ]
