"""A hostile Tinker client next to benign ones on one base model (run by the tinker venv's python).

Usage: python nan_neighbour.py BASE_MODEL NEIGHBOURS
Env: TINKER_BASE_URL, TINKER_API_KEY (the SDK reads them).

NEIGHBOURS + 1 LoRA training clients of BASE_MODEL (the worker serves them all on one shared
resource) each take one cross-entropy step and save sampler weights. Client 0 is hostile: before
it saves, it takes one more step whose decoupled weight decay (`learning_rate * weight_decay` =
1e37) flips and scales every adapter weight far past anything a forward can carry, yet keeps
them finite, so the worker accepts the step. Then each client samples alone, one after the
other (the neighbours' reference), then all of them at the same time, one sample each.

Prints one JSON object: the hostile model's id, the poisoning step's metrics, and what each
client's sample gave alone and together (its sequences, or the error the SDK raised). The
pytest side judges (tests/tinker/test_nan_neighbour.py).
"""

from __future__ import annotations

import sys
from typing import Any

import tinker
from tinker import types

from tests.tinker.sdk_scripts.report import print_result

LR = 1e-2
POISON = types.AdamParams(learning_rate=1.0, weight_decay=1e37)
ROWS, MAX_TOKENS = 4, 24


def batch(seed: int) -> list[types.Datum]:
    """Two cross-entropy sequences of `seed` (ids 6..33: plain words of the test vocabulary)."""
    out = []
    for k in range(2):
        tokens = [6 + (seed * 7 + k * 5 + j * 3) % 28 for j in range(10)]
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 9},
            )
        )
    return out


def prompt(i: int) -> types.ModelInput:
    return types.ModelInput.from_ints([6 + i % 20, 9, 12 + i % 7])


def params(i: int) -> types.SamplingParams:
    return types.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=100 + i)


def sequences(response: types.SampleResponse) -> list[dict[str, Any]]:
    return [
        {"tokens": list(s.tokens), "logprobs": list(s.logprobs or []), "stop": str(s.stop_reason)}
        for s in response.sequences
    ]


def outcome(future: Any) -> dict[str, Any]:
    """A sample future's sequences, or the error the SDK raised for it."""
    try:
        return {"sequences": sequences(future.result())}
    except Exception as exc:  # the hostile client's failure, as the SDK reports it
        return {"error": f"{type(exc).__name__}: {exc}"}


def main(base_model: str, neighbours: int) -> dict[str, Any]:
    service = tinker.ServiceClient()
    clients = [
        service.create_lora_training_client(base_model=base_model, rank=4, seed=i)
        for i in range(neighbours + 1)
    ]
    for i, client in enumerate(clients):
        client.forward_backward(batch(i), "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=LR)).result()
    hostile = clients[0]
    hostile.forward_backward(batch(0), "cross_entropy").result()
    poisoned = hostile.optim_step(POISON).result()
    samplers = [
        c.save_weights_and_get_sampling_client(f"nan-neighbour-{i}") for i, c in enumerate(clients)
    ]

    def sample(i: int) -> Any:
        return samplers[i].sample(prompt=prompt(i), num_samples=ROWS, sampling_params=params(i))

    alone = {i: outcome(sample(i)) for i in range(neighbours + 1)}  # one after the other
    futures = [sample(i) for i in range(neighbours + 1)]  # all in flight at once
    return {
        "hostile_model": str(hostile.get_info().model_id),
        "poison_metrics": dict(poisoned.metrics or {}),
        "alone": alone,
        "together": {i: outcome(f) for i, f in enumerate(futures)},
    }


if __name__ == "__main__":
    print_result(lambda: main(sys.argv[1], int(sys.argv[2])))
