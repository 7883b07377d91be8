"""What both arms of `scripts/bench_grpo_steps.py` share: the GRPO step's rewards, datums and
client-side loss (the cookbook's shape: a group of completions of one prompt, advantages
centred on the group's mean, a policy-gradient loss through `forward_backward_custom`).
Imported by each arm's script from its own venv, so it uses only what both SDKs' `types`
modules have."""

from __future__ import annotations

from typing import Any

PROMPT = [10, 11, 12, 13, 14, 15, 16, 17]
GOOD_BELOW = 20  # the reward: the share of completion tokens with smaller ids
LR = 1e-3


def rewards(completions: list[list[int]]) -> list[float]:
    scores = [sum(t < GOOD_BELOW for t in c) / max(1, len(c)) for c in completions]
    mean = sum(scores) / len(scores)
    return [s - mean for s in scores]


def datums(types: Any, completions: list[list[int]]) -> list[Any]:
    out = []
    for completion in completions:
        tokens = PROMPT + completion
        n = len(tokens) - 1
        weights = [0.0 if i + 1 < len(PROMPT) else 1.0 for i in range(n)]
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": types.TensorData(data=tokens[1:], dtype="int64", shape=[n]),
                    "weights": types.TensorData(data=weights, dtype="float32", shape=[n]),
                },
            )
        )
    return out


def loss_fn(advantages: list[float]) -> Any:
    import torch

    def loss(batch: Any, logprobs_list: list[Any]) -> tuple[Any, dict[str, float]]:
        total = torch.zeros(())
        for logprobs, advantage in zip(logprobs_list, advantages, strict=True):
            total = total - advantage * logprobs[len(PROMPT) - 1 :].sum()
        return total, {"pg_loss": float(total)}

    return loss
