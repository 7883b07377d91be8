"""Builders for wire samples and a reference for logprobs computed outside the worker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def model_input(tokens: list[int]) -> dict[str, Any]:
    return {"chunks": [{"encoded_text": {"tokens": tokens}}]}


def tensor(values: list[float] | list[int], dtype: str = "float32") -> dict[str, Any]:
    return {"data": list(values), "dtype": dtype}


def ce_sample(sequence: list[int], weights: list[float] | None = None) -> dict[str, Any]:
    """Cross-entropy sample over `sequence`: input = seq[:-1], targets = seq[1:]."""
    n = len(sequence) - 1
    return {
        "model_input": model_input(sequence[:-1]),
        "loss_fn_inputs": {
            "target_tokens": tensor(sequence[1:], "int64"),
            "weights": tensor(weights if weights is not None else [1.0] * n),
        },
    }


def policy_sample(
    sequence: list[int],
    logprobs: list[float],
    advantages: list[float],
    reference: list[float] | None = None,
) -> dict[str, Any]:
    n = len(sequence) - 1
    inputs = {
        "target_tokens": tensor(sequence[1:], "int64"),
        "logprobs": tensor(logprobs),
        "advantages": tensor(advantages),
        "mask": tensor([1.0] * n),
    }
    if reference is not None:
        inputs["reference_logprobs"] = tensor(reference)
    return {"model_input": model_input(sequence[:-1]), "loss_fn_inputs": inputs}


SEQUENCES = [[3, 17, 42, 9, 88, 5, 61, 20], [7, 7, 100, 2, 45, 12]]

LOSSES: list[dict[str, Any]] = [
    {"type": "LOSS_TYPE_IMPORTANCE_SAMPLING"},
    {
        "type": "LOSS_TYPE_PPO",
        "ppo_params": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    },
    {
        "type": "LOSS_TYPE_CISPO",
        "cispo_params": {"clip_low_threshold": 0.0, "clip_high_threshold": 5.0},
    },
    {"type": "LOSS_TYPE_DRO", "dro_params": {"beta": 0.1}},
    {"type": "LOSS_TYPE_DPPO", "dppo_params": {"delta_low": 0.15, "delta_high": 0.15}},
    {
        "type": "LOSS_TYPE_GRPO",
        "grpo_params": {
            "clip_low_threshold": 0.8,
            "clip_high_threshold": 1.28,
            "beta": 0.05,
            "agg_type": "GRPO_LOSS_AGGREGATION_TYPE_TOKEN_MEAN",
            "ratio_type": "GRPO_LOSS_RATIO_TYPE_TOKEN",
        },
    },
]


@torch.no_grad()
def reference_logprobs(model: Any, sequence: list[int]) -> list[float]:
    """log p(seq[t+1] | seq[:t+1]) from a plain transformers/peft model, in fp32."""
    ids = torch.tensor([sequence[:-1]])
    logits = model(input_ids=ids).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, torch.tensor(sequence[1:])[:, None])[:, 0].tolist()


def load_causal_lm(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
