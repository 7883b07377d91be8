"""The Fireworks training SDK's lifecycle, minus deployments, against `trainer serve`.

Run it with `fireworks-ai[training-sdk]` (1.2.9 or later) installed, in its own venv:

    export FIREWORKS_BASE_URL=http://127.0.0.1:8321
    export FIREWORKS_API_KEY=$TRAINER_API_TOKEN
    python scripts/fireworks_example.py --model accounts/fireworks/models/qwen3-0.6b

`TrainerJobManager.create_and_wait` makes an RLOR trainer job (a LoRA resource of the worker,
`--rank 0` for full weights) and waits until it runs; `FiretitanServiceClient` on the job's
endpoint takes `--steps` cross-entropy steps on one token sequence, printing the loss,
reads the base model's logprobs through a frozen reference (`create_base_training_client`, a
LoRA job only), saves the state under a logical name, loads it back with its optimizer and
lists the job's checkpoints. The job is deleted at the end; its checkpoints stay. The last line
it prints is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os

from fireworks.training.sdk import FiretitanServiceClient, TrainerJobConfig, TrainerJobManager

try:  # 1.2.30 vendors its Tinker types; 1.2.9 uses the tinker package
    from fireworks.training.sdk import types
except ImportError:
    from tinker import types  # type: ignore[no-redef]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a base model the worker serves")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank; 0 trains full weights")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--tokens", default="10,11,12,13,14,15,16,17,18,19")
    args = parser.parse_args()
    key, url = os.environ["FIREWORKS_API_KEY"], os.environ["FIREWORKS_BASE_URL"]

    jobs = TrainerJobManager(api_key=key, base_url=url)
    endpoint = jobs.create_and_wait(
        TrainerJobConfig(
            base_model=args.model,
            lora_rank=args.rank,
            learning_rate=args.lr,
            display_name="example-trainer",
            region="US_VIRGINIA_1",  # stored and echoed; one worker has one place
        ),
        poll_interval_s=1.0,
    )
    print(f"trainer job {endpoint.job_id} runs at {endpoint.base_url}")
    service = FiretitanServiceClient(base_url=endpoint.base_url, api_key=key)
    policy = service.create_training_client(base_model=args.model, lora_rank=args.rank)

    tokens = [int(t) for t in args.tokens.split(",")]
    n = len(tokens) - 1
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=tokens[1:], dtype="int64", shape=[n]),
            "weights": types.TensorData(data=[1.0] * n, dtype="float32", shape=[n]),
        },
    )
    losses = []
    for step in range(args.steps):
        result = policy.forward_backward([datum], "cross_entropy").result()
        policy.optim_step(
            types.AdamParams(learning_rate=args.lr),
            grad_accumulation_normalization="num_loss_tokens",
        ).result()
        losses.append(result.metrics["loss:sum"] / n)
        print(f"step {step}: loss per token {losses[-1]:.4f}")

    base_logprob = None
    if args.rank > 0:  # a frozen reference on the same job: the base model's logprobs
        reference = service.create_base_training_client(base_model=args.model)
        forward = reference.forward([datum], "cross_entropy").result()
        base_logprob = sum(forward.loss_fn_outputs[0]["logprobs"].data) / n

    saved = policy.save_state("example").result().path
    policy.load_state_with_optimizer(saved).result()
    checkpoints = policy.list_checkpoints()
    jobs.delete(endpoint.job_id)
    print(f"saved {saved}; the job's checkpoints: {checkpoints}")
    summary = {
        "job_id": endpoint.job_id,
        "losses": losses,
        "base_logprob_per_token": base_logprob,
        "saved": saved,
        "checkpoints": checkpoints,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
