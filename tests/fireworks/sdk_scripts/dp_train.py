"""Drive the worker's Tinker routes with the Fireworks SDK's FiretitanServiceClient directly.

    python dp_train.py <base_model> <lora_rank> <seed_tokens_json>

Steps (each result printed in one JSON object at the end):
- `forward` of each sequence (cross entropy, with the cookbook's extra `loss_mask` input);
- two `forward_backward` + `optim_step(grad_accumulation_normalization="num_loss_tokens")`;
- `save_state("step-1")`, then one more step A (loss, logprobs);
- a second model `load_state_with_optimizer(<returned path>)`, the same step B: A == B;
- `forward_backward_custom` with a client-side GRPO-style loss;
- `list_checkpoints`; `save_weights_for_sampler_ext(checkpoint_type="base")`;
- `create_base_training_client`: its `forward` logprobs (the base model's).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
from fireworks.training.sdk.client import FiretitanServiceClient

try:  # 1.2.30 vendors tinker 0.23 as `_core`; 1.2.9 depends on the `tinker` package
    from fireworks.training.sdk._core import types
except ImportError:  # pragma: no cover - the other SDK line
    from tinker import types  # type: ignore[no-redef]


def datum(tokens: list[int], extra: bool = False) -> Any:
    inputs: dict[str, Any] = {
        "target_tokens": types.TensorData(data=tokens[1:], dtype="int64", shape=[len(tokens) - 1]),
        "weights": types.TensorData(
            data=[1.0] * (len(tokens) - 1), dtype="float32", shape=[len(tokens) - 1]
        ),
    }
    if extra:  # what the cookbook's reference forward sends besides
        inputs["loss_mask"] = types.TensorData(
            data=[1.0] * (len(tokens) - 1), dtype="float32", shape=[len(tokens) - 1]
        )
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def logprobs(out: Any) -> list[list[float]]:
    return [[float(v) for v in o["logprobs"].data] for o in out.loss_fn_outputs]


ADAM = types.AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8)


def step(client: Any, data: list[Any]) -> dict[str, Any]:
    fb = client.forward_backward(data, "cross_entropy").result()
    opt = client.optim_step(ADAM, grad_accumulation_normalization="num_loss_tokens").result()
    return {"loss": fb.metrics["loss:sum"], "opt": dict(opt.metrics or {})}


def main() -> None:
    base_model, rank, seqs = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    service = FiretitanServiceClient(
        base_url=os.environ["FIREWORKS_BASE_URL"], api_key=os.environ["FIREWORKS_API_KEY"]
    )
    out: dict[str, Any] = {}
    client = service.create_training_client(base_model=base_model, lora_rank=rank, seed=0)
    info = client.get_info()
    out["info"] = {"is_lora": info.is_lora, "lora_rank": info.lora_rank}
    data = [datum(s) for s in seqs]
    out["forward"] = logprobs(
        client.forward([datum(s, True) for s in seqs], "cross_entropy").result()
    )
    out["steps"] = [step(client, data) for _ in range(2)]
    saved = client.save_state("step-1").result()
    out["saved_path"] = saved.path
    after = step(client, data)
    out["continued"] = {
        "step": after,
        "logprobs": logprobs(client.forward(data, "cross_entropy").result()),
    }
    resumed = service.create_training_client(base_model=base_model, lora_rank=rank, seed=1)
    resumed.load_state_with_optimizer(saved.path).result()
    again = step(resumed, data)
    out["resumed"] = {
        "step": again,
        "logprobs": logprobs(resumed.forward(data, "cross_entropy").result()),
    }

    def grpo(data_: list[Any], lps: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        advantages = [1.0, -1.0]
        loss = sum(-a * lp.sum() / lp.numel() for a, lp in zip(advantages, lps, strict=False))
        return loss, {"grpo": float(loss)}

    custom = resumed.forward_backward_custom(data, grpo).result()
    out["custom_metrics"] = {k: float(v) for k, v in custom.metrics.items()}
    out["list"] = client.list_checkpoints()
    sampler = client.save_weights_for_sampler_ext("sampler-1", checkpoint_type="base")
    out["sampler_path"] = getattr(sampler, "path", None)
    base = service.create_base_training_client(base_model)
    out["base_forward"] = logprobs(base.forward(data, "cross_entropy").result())
    try:
        base.forward_backward(data, "cross_entropy").result()
        out["base_fb"] = "accepted"
    except Exception as exc:  # the SDK raises the worker's 400
        out["base_fb"] = str(exc)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
