"""A trainer job's life through the official SDK, against the worker in FIREWORKS_BASE_URL.

    python cp_lifecycle.py <base_model> <lora_rank> <model_id>

`TrainerJobManager.create_and_wait` (RUNNING + healthz), a LoRA or full-weight model trained
one step through the job's gateway (`FiretitanServiceClient(base_url=endpoint.base_url)`),
`save_state` and `save_weights_for_sampler`, the job's checkpoints (`list_checkpoints`),
promotion of the newest promotable one, the promoted adapter loaded back (`load_adapter`),
`model_is_moe`, and the job deleted. Prints one JSON
object; a step the worker refused is reported, not raised, from the checkpoints on.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from fireworks.training.sdk import FiretitanServiceClient, FireworksClient
from fireworks.training.sdk.trainer import TrainerJobConfig, TrainerJobManager

try:  # 1.2.30 vendors its tinker types; 1.2.9 uses the tinker package
    from fireworks.training.sdk import types
except ImportError:
    from tinker import types  # type: ignore[no-redef]


def datum(tokens: list[int]) -> Any:
    n = len(tokens) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=tokens[1:], dtype="int64", shape=[n]),
            "weights": types.TensorData(data=[1.0] * n, dtype="float32", shape=[n]),
        },
    )


def main() -> None:
    base_model, rank, model_id = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    key, url = os.environ["FIREWORKS_API_KEY"], os.environ["FIREWORKS_BASE_URL"]
    out: dict[str, Any] = {}
    manager = TrainerJobManager(api_key=key, base_url=url)
    endpoint = manager.create_and_wait(
        TrainerJobConfig(base_model=base_model, lora_rank=rank, display_name="sdk-job"),
        poll_interval_s=0.2,
        timeout_s=120,
    )
    out["job_id"] = endpoint.job_id
    out["base_url"] = endpoint.base_url
    out["max_context_length"] = endpoint.max_context_length
    out["state"] = manager.get(endpoint.job_id)["state"]

    service = FiretitanServiceClient(base_url=endpoint.base_url, api_key=key)
    trainer = service.create_training_client(base_model=base_model, lora_rank=rank)
    batch = [datum(list(range(3, 19))), datum(list(range(5, 17)))]
    fb = trainer.forward_backward(batch, "cross_entropy").result()
    out["loss_keys"] = sorted(fb.metrics)
    trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    out["state_path"] = trainer.save_state("step-1").result().path
    out["sampler_path"] = trainer.save_weights_for_sampler("final").result().path

    control = FireworksClient(api_key=key, base_url=url)
    rows = control.list_checkpoints(endpoint.job_id)
    out["checkpoints"] = [
        {k: r.get(k) for k in ("name", "checkpointType", "promotable", "createTime")} for r in rows
    ]
    promotable = sorted((r for r in rows if r.get("promotable")), key=lambda r: r["createTime"])
    if promotable:
        model = control.promote_checkpoint(
            name=promotable[-1]["name"], output_model_id=model_id, base_model=base_model
        )
        out["promoted"] = {k: model.get(k) for k in ("name", "kind", "state", "peftDetails")}
        try:  # through the Tinker bridge's model_resolvers
            trainer.load_adapter(str(model["name"])).result()
            out["adapter_loaded"] = True
        except Exception as exc:  # reported: the test names what failed
            out["adapter_loaded"] = f"{type(exc).__name__}: {exc}"[:2000]
    out["moe"] = control.model_is_moe(base_model)
    manager.delete(endpoint.job_id)
    out["after_delete"] = manager.get(endpoint.job_id)["state"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
