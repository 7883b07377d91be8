"""Publish, copy and read another user's checkpoint through the SDK (the tinker venv's python).

Usage: python publish.py MODE BASE_MODEL [PATHS...], the user being TINKER_API_KEY's:
- `owner BASE`: train a LoRA model one step, save sampler weights (`shared`), a state and
  external weights, publish all three; report the paths, the model's logprobs and a greedy
  sample;
- `reader BASE SAMPLER STATE EXTERNAL`: sample SAMPLER, load STATE
  (`create_training_client_from_state`), download EXTERNAL's files, copy SAMPLER and sample the
  copy, try to delete and unpublish SAMPLER; report what each gave;
- `unpublish BASE SAMPLER`: unpublish it; report its listed `public`;
- `denied BASE SAMPLER`: report the HTTP status of `weights_info` on it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import httpx
import tinker
from tinker import types

from tests.tinker.sdk_scripts.report import print_result

TOKENS = [3, 17, 42, 9, 77, 5]
DATA = [
    types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)},
    )
]
GREEDY = types.SamplingParams(max_tokens=3, seed=0, temperature=0.0)


def logprobs(client: tinker.TrainingClient) -> list[float]:
    out = client.forward(DATA, "cross_entropy").result().loss_fn_outputs[0]
    return [float(x) for x in out["logprobs"].tolist()]


def sampled(service: tinker.ServiceClient, path: str) -> list[int]:
    client = service.create_sampling_client(model_path=path)
    prompt = types.ModelInput.from_ints(TOKENS[:3])
    return list(client.sample(prompt, 1, GREEDY).result().sequences[0].tokens)


def status(call: Callable[[], Any]) -> int:
    try:
        call()
    except tinker.APIStatusError as exc:
        return int(exc.status_code)
    return 200


def owner(base_model: str) -> dict[str, Any]:
    service = tinker.ServiceClient()
    rest = tinker.RestClient()
    trained = service.create_lora_training_client(base_model=base_model, rank=2, seed=0)
    trained.forward_backward(DATA, "cross_entropy").result()
    trained.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    sampler = trained.save_weights_for_sampler("shared").result().path
    state = trained.save_state("shared-state").result().path
    external = trained.save_weights_external("shared-external").result().path
    for path in (sampler, state, external):
        rest.publish_checkpoint_from_tinker_path(path).result()
    return {
        "sampler": sampler,
        "state": state,
        "external": external,
        "logprobs": logprobs(trained),
        "sampled": sampled(service, sampler),
    }


def reader(base_model: str, sampler: str, state: str, external: str) -> dict[str, Any]:
    service = tinker.ServiceClient()
    rest = tinker.RestClient()
    loaded = service.create_training_client_from_state(state).result()
    urls = rest.get_external_weights_urls(external).result().urls
    assert all(httpx.get(url).status_code == 200 for url in urls.values())
    copy = rest.copy_weights(sampler, "proj").result()
    mine = [c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints]
    return {
        "sampled": sampled(service, sampler),
        "loaded_logprobs": logprobs(loaded),
        "downloaded": sorted(urls),
        "copy": copy,
        "copy_listed": copy in mine,
        "copy_sampled": sampled(service, copy),
        "delete_status": status(lambda: rest.delete_checkpoint_from_tinker_path(sampler).result()),
        "unpublish_status": status(
            lambda: rest.unpublish_checkpoint_from_tinker_path(sampler).result()
        ),
    }


def unpublish(base_model: str, sampler: str) -> dict[str, Any]:
    rest = tinker.RestClient()
    rest.unpublish_checkpoint_from_tinker_path(sampler).result()
    listed = rest.list_user_checkpoints().result().checkpoints
    return {"public": next(c.public for c in listed if c.tinker_path == sampler)}


def denied(base_model: str, sampler: str) -> dict[str, Any]:
    rest = tinker.RestClient()
    return {"status": status(lambda: rest.get_weights_info_by_tinker_path(sampler).result())}


MODES: dict[str, Callable[..., dict[str, Any]]] = {
    "owner": owner,
    "reader": reader,
    "unpublish": unpublish,
    "denied": denied,
}

if __name__ == "__main__":
    print_result(lambda: MODES[sys.argv[1]](*sys.argv[2:]))
