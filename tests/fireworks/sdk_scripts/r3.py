"""R3 (rollout routing replay) through the Fireworks SDK unchanged, on an MoE base model.

    python r3.py <base_model> <prompt_json>

Steps (each result printed in one JSON object at the end):
- `create_training_client(lora_rank=0)`: its `supports_router_replay`, `routing_matrix_format`;
- `DeploymentSampler.sample_with_prompt_tokens(include_routing_matrix=True)` on the base model,
  completion-only and echoed (the same seed): each completion's SDK-aligned matrices;
- `forward` of datums whose `ModelInput.from_ints(tokens[:-1], routing_matrices=...)` are
  built as the cookbook's `build_r3_routing_matrices` builds them (echoed: as they come;
  completion-only: the prompt's positions but the last blank), and without matrices;
- two large `forward_backward` + `optim_step` steps, then the three forwards again;
- one datum whose matrix names an expert out of range: the server's refusal.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import sys
from typing import Any

from fireworks.training.sdk.client import FiretitanServiceClient
from fireworks.training.sdk.sampling import DeploymentSampler

try:  # 1.2.30 vendors tinker 0.23 as `_core`
    from fireworks.training.sdk._core import types
except ImportError:  # pragma: no cover - the other SDK line
    from tinker import types  # type: ignore[no-redef]


def datum(tokens: list[int], matrices: list[str] | None) -> Any:
    n = len(tokens) - 1
    inputs = {
        "target_tokens": types.TensorData(data=tokens[1:], dtype="int64", shape=[n]),
        "weights": types.TensorData(data=[1.0] * n, dtype="float32", shape=[n]),
    }
    model_input = types.ModelInput.from_ints(tokens[:-1], routing_matrices=matrices)
    return types.Datum(model_input=model_input, loss_fn_inputs=inputs)


def logprobs(out: Any) -> list[list[float]]:
    return [[float(v) for v in o["logprobs"].data] for o in out.loss_fn_outputs]


async def sample(sampler: DeploymentSampler, prompt: list[int], echo: bool) -> Any:
    got = await sampler.sample_with_prompt_tokens(
        prompt,
        n=1,
        max_tokens=8,
        temperature=1.0,
        logprobs=True,
        include_routing_matrix=True,
        echo=echo,
        seed=11,
    )
    return got[0]


def main() -> None:
    base_model, prompt = sys.argv[1], json.loads(sys.argv[2])
    url, key = os.environ["FIREWORKS_BASE_URL"], os.environ["FIREWORKS_API_KEY"]
    service = FiretitanServiceClient(base_url=url, api_key=key)
    client = service.create_training_client(base_model=base_model, lora_rank=0, seed=0)
    out: dict[str, Any] = {
        "supports_router_replay": client.supports_router_replay,
        "routing_matrix_format": client.routing_matrix_format,
    }
    sampler = DeploymentSampler(inference_url=url, model=base_model, api_key=key)
    plain = asyncio.run(sample(sampler, prompt, echo=False))
    echoed = asyncio.run(sample(sampler, prompt, echo=True))
    tokens = list(plain.full_tokens)
    p = plain.prompt_len
    matrices = {
        "full": list(echoed.routing_matrices),  # P + C - 1: training-aligned by the SDK
        "completion_only": [""] * (p - 1) + list(plain.routing_matrices),
    }
    out.update(
        tokens=tokens,
        echoed_tokens=list(echoed.full_tokens),
        prompt_len=p,
        matrices=matrices,
        sampling_logprobs=list(plain.sampling_logprobs),
    )
    data = [datum(tokens, matrices["full"]), datum(tokens, matrices["completion_only"])]
    data.append(datum(tokens, None))
    out["before"] = logprobs(client.forward(data, "cross_entropy").result())
    adam = types.AdamParams(learning_rate=0.05, beta1=0.9, beta2=0.95, eps=1e-8)
    for _ in range(2):
        client.forward_backward([datum(tokens, None)] * 2, "cross_entropy").result()
        client.optim_step(adam).result()
    out["after"] = logprobs(client.forward(data, "cross_entropy").result())
    bad = list(matrices["full"])
    bad[2] = base64.b64encode(bytes([0, 1, 2, 9])).decode()
    try:
        client.forward([datum(tokens, bad)], "cross_entropy").result()
        out["bad"] = "accepted"
    except Exception as exc:  # the SDK's error for a failed request
        out["bad"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(out))


if __name__ == "__main__":
    main()
