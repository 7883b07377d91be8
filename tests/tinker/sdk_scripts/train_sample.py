"""Drive the worker with the official `tinker` SDK (run by the tinker venv's python).

Usage: python train_sample.py BASE_MODEL DOWNLOAD_DIR
Env: TINKER_BASE_URL, TINKER_API_KEY (the SDK reads them).

Prints one JSON object with what the SDK returned; the pytest side checks the numbers
(tests/tinker/test_sdk.py). Nothing here judges results, except that each step succeeds.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import tinker
import torch
from tinker import types

from tests.tinker.sdk_scripts.report import error_text, print_result

LR = 1e-2
RANK = 4


def datums(rng: np.random.Generator, n: int, length: int, low: int, high: int) -> list[dict]:
    """Plain token lists; each becomes input = tokens[:-1], target = tokens[1:]."""
    out = []
    for _ in range(n):
        tokens = rng.integers(low, high, size=length + 1).tolist()
        weights = [0.0] * 2 + rng.uniform(0.5, 1.5, size=length - 2).round(3).tolist()
        out.append({"tokens": tokens, "weights": weights})
    return out


def ce_datum(d: dict) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(d["tokens"][:-1]),
        loss_fn_inputs={"target_tokens": d["tokens"][1:], "weights": d["weights"]},
    )


def rl_datum(d: dict, old: list[float], adv: list[float], mask: bool = False) -> types.Datum:
    inputs: dict[str, Any] = {"target_tokens": d["tokens"][1:], "logprobs": old, "advantages": adv}
    if mask:  # the ratio over positions 2.. (the "sampled" part); no advantage before it
        inputs["sequence_ratio_mask"] = [0.0, 0.0] + [1.0] * (len(old) - 2)
        inputs["advantages"] = [0.0, 0.0, *adv[2:]]
    return types.Datum(
        model_input=types.ModelInput.from_ints(d["tokens"][:-1]), loss_fn_inputs=inputs
    )


def logprobs_of(result: types.ForwardBackwardOutput) -> list[list[float]]:
    return [[float(x) for x in out["logprobs"].tolist()] for out in result.loss_fn_outputs]


def summary(result: types.ForwardBackwardOutput) -> dict[str, Any]:
    return {"logprobs": logprobs_of(result), "metrics": dict(result.metrics)}


def main(base_model: str, download_dir: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    service = tinker.ServiceClient()
    caps = service.get_server_capabilities()
    out["capabilities"] = [m.model_name for m in caps.supported_models]

    training = service.create_lora_training_client(base_model=base_model, rank=RANK, seed=0)
    info = training.get_info()
    out["info"] = {
        "model_name": info.model_data.model_name,
        "tokenizer_id": info.model_data.tokenizer_id,
        "lora_rank": info.lora_rank,
        "model_id": str(info.model_id),
    }
    tokenizer = training.get_tokenizer()
    out["tokenizer_roundtrip"] = tokenizer.decode(tokenizer.encode("what is two plus three"))
    timings["setup"] = time.monotonic() - t0

    rng = np.random.default_rng(0)
    vocab = len(tokenizer)
    raw = datums(rng, 3, 10, 6, vocab)
    out["data"] = raw
    ce = [ce_datum(d) for d in raw]

    # forward: no gradient, the reference logprobs for everything below
    t0 = time.monotonic()
    fwd = training.forward(ce, "cross_entropy").result()
    out["forward_ce"] = summary(fwd)
    # the weights the policy gradient losses see: every position (no weights field)
    fwd_all = training.forward(
        [rl_datum(d, [0.0] * 10, [0.0] * 10) for d in raw], "importance_sampling"
    )
    lp_all = logprobs_of(fwd_all.result())
    out["forward_all"] = lp_all

    # forward_backward with every served loss; old logprobs = current + known offsets
    old = [(np.array(lp) + rng.uniform(-0.3, 0.3, size=len(lp))).round(4).tolist() for lp in lp_all]
    adv = [rng.choice([-1.0, -0.5, 0.5, 1.0], size=len(lp)).tolist() for lp in lp_all]
    out["old"], out["adv"] = old, adv
    configs: dict[str, dict[str, float] | None] = {
        "importance_sampling": None,
        "ppo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
        "cispo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
        "dro": {"beta": 0.5},
        "gspo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
    }
    out["config"] = configs
    losses: dict[str, Any] = {
        "cross_entropy": summary(training.forward_backward(ce, "cross_entropy").result())
    }
    for name, config in configs.items():
        data = [rl_datum(d, o, a, mask=name == "gspo") for d, o, a in zip(raw, old, adv)]
        losses[name] = summary(training.forward_backward(data, name, config).result())
        losses[name + "/forward"] = summary(training.forward(data, name, config).result())
    out["losses"] = losses

    def half_ce(
        data: list[types.Datum], logprobs: list[torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        loss = sum(
            -(0.5 * d.loss_fn_inputs["weights"].to_torch() * lp).sum()
            for d, lp in zip(data, logprobs)
        )
        assert isinstance(loss, torch.Tensor)
        return loss, {"half_ce": float(loss.detach())}

    custom = training.forward_backward_custom(ce, half_ce).result()
    out["custom"] = summary(custom)
    out["stable_reinforce_error"] = error_text(
        lambda: training.forward_backward(
            [rl_datum(d, o, a) for d, o, a in zip(raw, old, adv)], "stable_reinforce"
        ).result()
    )
    out["bad_dro_error"] = error_text(
        lambda: training.forward_backward(
            [rl_datum(d, o, a) for d, o, a in zip(raw, old, adv)], "dro"
        ).result()
    )
    timings["losses"] = time.monotonic() - t0

    # drop the gradients accumulated above: a step with lr 0 (Adam state moves, weights do not)
    t0 = time.monotonic()
    zero = training.optim_step(types.AdamParams(learning_rate=0.0)).result()
    out["zero_step"] = {"metrics": dict(zero.metrics or {})}
    out["after_zero_step"] = logprobs_of(training.forward(ce, "cross_entropy").result())

    state0 = training.save_state("before").result().path
    out["state0"] = state0

    # one SL step with a known lr, then the state every resume starts from
    training.forward_backward(ce, "cross_entropy").result()
    step1 = training.optim_step(
        types.AdamParams(learning_rate=LR, beta1=0.9, beta2=0.95, eps=1e-8)
    ).result()
    out["step1"] = {"metrics": dict(step1.metrics or {})}
    out["after_step1"] = logprobs_of(training.forward(ce, "cross_entropy").result())
    state1 = training.save_state("step1").result().path
    out["state1"] = state1

    def step2(client: tinker.TrainingClient) -> list[list[float]]:
        client.forward_backward(ce, "cross_entropy").result()
        client.optim_step(
            types.AdamParams(learning_rate=LR, beta1=0.9, beta2=0.95, eps=1e-8)
        ).result()
        return logprobs_of(client.forward(ce, "cross_entropy").result())

    out["continued"] = step2(training)
    training.load_state_with_optimizer(state1).result()
    out["reloaded_with_optimizer"] = logprobs_of(training.forward(ce, "cross_entropy").result())
    out["resumed_with_optimizer"] = step2(training)
    training.load_state(state1).result()
    out["reloaded_weights_only"] = logprobs_of(training.forward(ce, "cross_entropy").result())
    out["resumed_weights_only"] = step2(training)
    fresh = service.create_training_client_from_state_with_optimizer(state1)
    out["fresh_from_state"] = step2(fresh)
    timings["train_resume"] = time.monotonic() - t0

    # sampling after save_weights_and_get_sampling_client, checked against the trainer
    t0 = time.monotonic()
    training.load_state_with_optimizer(state1).result()
    sampler = training.save_weights_and_get_sampling_client()
    prompt = raw[0]["tokens"][:6]
    response = sampler.sample(
        prompt=types.ModelInput.from_ints(prompt),
        num_samples=2,
        sampling_params=types.SamplingParams(max_tokens=6, temperature=1.0, seed=7),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=3,
    ).result()
    sequences = [
        {"tokens": list(s.tokens), "logprobs": list(s.logprobs or []), "stop": str(s.stop_reason)}
        for s in response.sequences
    ]
    out["sample"] = {
        "prompt": prompt,
        "sequences": sequences,
        "prompt_logprobs": [
            None if x is None or x != x else float(x) for x in (response.prompt_logprobs or [])
        ],
        "topk_prompt_logprobs": [
            None if row is None else [[int(t), float(v)] for t, v in row]
            for row in (response.topk_prompt_logprobs or [])
        ],
    }
    rescored = []
    for seq in sequences:
        full = prompt + seq["tokens"]
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(full[:-1]),
            loss_fn_inputs={"target_tokens": full[1:], "weights": [1.0] * (len(full) - 1)},
        )
        rescored.append(logprobs_of(training.forward([datum], "cross_entropy").result())[0])
    out["rescored"] = rescored
    timings["sample"] = time.monotonic() - t0

    # the REST face: runs, checkpoints
    t0 = time.monotonic()
    rest = service.create_rest_client()
    runs = rest.list_training_runs().result()
    out["runs"] = [r.training_run_id for r in runs.training_runs]
    listing = rest.list_checkpoints(info.model_id).result()
    out["checkpoints"] = [
        {"id": c.checkpoint_id, "type": c.checkpoint_type, "path": c.tinker_path}
        for c in listing.checkpoints
    ]
    # the state1 weights as a PEFT adapter, downloaded through signed URLs (no API key)
    external = training.save_weights_external("exported").result().path
    urls = rest.get_external_weights_urls(external).result()
    download_dir.mkdir(parents=True, exist_ok=True)
    for name, url in urls.urls.items():
        response = httpx.get(url, timeout=60)
        response.raise_for_status()
        (download_dir / name).write_bytes(response.content)
    out["external"] = {"path": external, "files": sorted(urls.urls)}
    unsigned = next(iter(urls.urls.values())).split("?")[0]
    out["unsigned_status"] = httpx.get(unsigned, timeout=60).status_code
    timings["rest"] = time.monotonic() - t0
    out["timings"] = timings
    return out


if __name__ == "__main__":
    print_result(lambda: main(sys.argv[1], Path(sys.argv[2])))
