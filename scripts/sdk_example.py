"""Drive a running worker with the official `together` SDK through a short RL-style loop.

Start a worker first (this script starts nothing), e.g. with a local or hub model:

    export TRAINER_API_TOKEN=$(python3 -c "import secrets; print(secrets.token_hex(16))")
    trainer serve --host 127.0.0.1 --port 8321 --storage ./runs/worker \\
        --model qwen3-0.6b=Qwen/Qwen3-0.6B

then, in another shell with the same TRAINER_API_TOKEN:

    python3 scripts/sdk_example.py --base-url http://127.0.0.1:8321/v1 --model qwen3-0.6b

It creates a LoRA resource and session, runs cross-entropy steps on a toy sequence, publishes the
weights, samples from them, saves a training and an inference checkpoint, downloads the adapter,
and stops everything. Every call is the SDK's own: the same script runs against the hosted API.
"""

from __future__ import annotations

import argparse
import os
import tempfile

from together import Together
from together.post_training import ModelResourcesClient, download_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8321/v1")
    parser.add_argument("--model", required=True, help="a base_model the worker serves")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args()
    api_key = os.environ["TRAINER_API_TOKEN"]

    # A toy sequence of token ids: model_input = seq[:-1], targets = seq[1:].
    sequence = [3, 17, 42, 9, 88, 5, 61, 20]
    sample = {
        "model_input": {"chunks": [{"encoded_text": {"tokens": sequence[:-1]}}]},
        "loss_fn_inputs": {
            "target_tokens": {"data": sequence[1:], "dtype": "int64"},
            "weights": {"data": [1.0] * (len(sequence) - 1), "dtype": "float32"},
        },
    }
    loss = {"type": "LOSS_TYPE_CROSS_ENTROPY"}

    with ModelResourcesClient.create(
        api_key=api_key, base_url=args.base_url, base_model=args.model, interval=1.0
    ) as resource:
        session = resource.create_session(lora_config={"rank": args.rank, "seed": 0}, interval=1.0)
        trainer = session.trainer
        for step in range(args.steps):
            result = trainer.forward_backward(samples=[sample], loss=loss)
            trainer.optim_step(adam_params={"learning_rate": 1e-3})
            print(f"step {step} | loss {result.loss:.4f}")
        version = trainer.weights_sync().weights_version
        completion = session.generator.sample(
            {"chunks": [{"encoded_text": {"tokens": sequence[:3]}}]},
            num_samples=2,
            sampling_params={"max_tokens": 8, "temperature": 1.0, "seed": 0},
        )
        for seq in completion.sequences:
            print(f"sampled (policy v{version}): {seq.tokens} {seq.stop_reason}")
        training = session.create_training_checkpoint()
        inference = session.create_inference_checkpoint()
        print(f"checkpoints: training {training.id}, inference {inference.id}")
        with tempfile.TemporaryDirectory() as out:
            files = download_checkpoint(
                Together(api_key=api_key, base_url=args.base_url),
                inference.id,
                variant="CHECKPOINT_VARIANT_ADAPTER",
                output_dir=out,
            )
            print("adapter files:", sorted(f.name for f in files))
        session.stop()
    print("resource stopped")


if __name__ == "__main__":
    main()
