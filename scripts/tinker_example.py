"""A few supervised steps through the official `tinker` SDK against `trainer serve`.

Run it with the `tinker` SDK (>= 0.38) installed, in its own venv (`together` pins an older one):

    export TINKER_BASE_URL=http://127.0.0.1:8321
    export TINKER_API_KEY=tml-$TRAINER_API_TOKEN
    python scripts/tinker_example.py --model qwen3-0.6b

It creates a LoRA training client on the worker, takes `--steps` cross-entropy steps on one
sentence, printing the loss, saves the state (a `tinker://` path, resumable through either
API), and samples a continuation from the trained weights. The last line it prints is a JSON
summary.
"""

from __future__ import annotations

import argparse
import json

import tinker
from tinker import types


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a base model the worker serves")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--text", default="the cat sat on the mat")
    args = parser.parse_args()

    service = tinker.ServiceClient()  # TINKER_BASE_URL, TINKER_API_KEY
    served = [m.model_name for m in service.get_server_capabilities().supported_models]
    print(f"the worker serves: {served}")
    training = service.create_lora_training_client(base_model=args.model, rank=args.rank)
    tokenizer = training.get_tokenizer()

    tokens = tokenizer.encode(args.text, add_special_tokens=False)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    losses = []
    for step in range(args.steps):
        backward = training.forward_backward([datum], "cross_entropy")
        optim = training.optim_step(types.AdamParams(learning_rate=args.lr))
        loss = backward.result().metrics["loss:sum"] / (len(tokens) - 1)
        optim.result()
        losses.append(loss)
        print(f"step {step}: loss per token {loss:.4f}")

    checkpoint = training.save_state("example").result().path
    print(f"saved {checkpoint}")

    sampler = training.save_weights_and_get_sampling_client()
    prompt = types.ModelInput.from_ints(tokens[:2])
    result = sampler.sample(
        prompt=prompt,
        num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=8, temperature=0.0),
    ).result()
    text = tokenizer.decode(result.sequences[0].tokens)
    print(f"sample: {tokenizer.decode(tokens[:2])!r} -> {text!r}")
    print(json.dumps({"losses": losses, "checkpoint": checkpoint, "sample": text}))


if __name__ == "__main__":
    main()
