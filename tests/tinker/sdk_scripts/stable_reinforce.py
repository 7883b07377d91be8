"""`stable_reinforce` through the official `tinker` SDK (run by the tinker venv's python).

Usage: python stable_reinforce.py BASE_MODEL
Env: TINKER_BASE_URL, TINKER_API_KEY (the SDK reads them).

Samples with `record_stability_info=True`, builds datums with provenance exactly as
tinker-cookbook's `recipes/rl_loop.py` does (`with_sampled_provenance`), trains one step with
`stable_reinforce`, then runs the loss again on the same (now off-policy) datums, and sends each
malformed request the contract refuses. Prints what the SDK returned; the pytest side
(tests/tinker/test_stable_reinforce.py) checks the numbers against rule 13's formula.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

import tinker
import torch
from tinker import types

from tests.tinker.sdk_scripts.report import error_text, print_result

PROMPT = [8, 9, 10, 11, 12]
ADVANTAGES = [1.0, -0.5, 2.0, -1.5]
CONFIG = {"kl_coeff": 0.2, "truncation": 1.2}


def provenance(
    datum: types.Datum, prompt_length: int, num_sampled: int, sequence_id: str
) -> types.Datum:
    """rl_loop's spans: input = prompt + sampled[:-1], targets = the same shifted by one."""
    return datum.with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id=sequence_id, length=prompt_length),
            types.SampledProvenanceSpan(sequence_id=sequence_id, length=num_sampled - 1),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=sequence_id, offset=1, length=prompt_length - 1),
            types.SampledProvenanceSpan(sequence_id=sequence_id, length=num_sampled),
        ],
    )


def plain_datum(tokens: list[int], logprobs: list[float], advantage: float) -> types.Datum:
    pad = len(PROMPT) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(PROMPT + tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": [0] * pad + tokens,
            "logprobs": [0.0] * pad + logprobs,
            "advantages": [0.0] * pad + [advantage] * len(tokens),
        },
    )


def sample(client: tinker.SamplingClient, seed: int) -> list[types.SampledSequence]:
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=seed)
    prompt = types.ModelInput.from_ints(PROMPT)
    return list(client.sample(prompt, num_samples=4, sampling_params=params).result().sequences)


def main(base_model: str) -> dict[str, Any]:
    service = tinker.ServiceClient()
    training = service.create_lora_training_client(base_model=base_model, rank=4, seed=0)
    sampler = training.save_weights_and_get_sampling_client(record_stability_info=True).result()
    sequences = [s for s in sample(sampler, seed=5) if len(s.tokens) >= 2]
    assert sequences, "every sequence stopped after one token"
    datums = [
        provenance(
            plain_datum(list(s.tokens), list(s.logprobs or []), a),
            len(PROMPT),
            len(s.tokens),
            s.sequence_id,
        )
        for s, a in zip(sequences, ADVANTAGES, strict=False)
    ]
    out: dict[str, Any] = {
        "sequences": [
            {"id": s.sequence_id, "tokens": list(s.tokens), "logprobs": list(s.logprobs or [])}
            for s in sequences
        ],
        "advantages": ADVANTAGES[: len(datums)],
        "prompt": PROMPT,
        "config": CONFIG,
    }

    def run(kind: str, data: list[types.Datum]) -> dict[str, Any]:
        call = training.forward if kind == "forward" else training.forward_backward
        result = call(data, "stable_reinforce", loss_fn_config=CONFIG).result()
        return {
            "metrics": dict(result.metrics),
            "logprobs": [
                [float(x) for x in o["logprobs"].tolist()] for o in result.loss_fn_outputs
            ],
        }

    # the twin starts from the same weights and takes rule 13's gradient from a loss written
    # here (forward_backward_custom); a large eps keeps Adam's step sensitive to its scale
    twin = service.create_lora_training_client(base_model=base_model, rank=4, seed=0)
    adam = types.AdamParams(learning_rate=0.05, eps=1e-3)
    out["on_policy"] = run("forward_backward", datums)
    training.optim_step(adam).result()
    pad = len(PROMPT) - 1

    def rule_13(data: list[types.Datum], logprobs: list[Any]) -> tuple[Any, dict[str, float]]:
        total = logprobs[0].sum() * 0.0
        for lp, seq, advantage in zip(logprobs, sequences, ADVANTAGES, strict=False):
            p = lp[pad:]
            q = torch.tensor(seq.logprobs, dtype=torch.float32)
            w = torch.clamp(torch.exp(p - q), max=CONFIG["truncation"]).detach()
            d = q - p
            total = total + (-w * advantage * p + CONFIG["kl_coeff"] * (d.exp() - d - 1)).sum()
        return total, {}

    out["twin_loss"] = twin.forward_backward_custom(datums, rule_13).result().metrics["loss:sum"]
    twin.optim_step(adam).result()
    out["off_policy"] = run("forward", datums)  # the records of the first weights, now stale
    twin_after = twin.forward(datums, "stable_reinforce", loss_fn_config=CONFIG).result()
    out["twin_logprobs"] = [
        [float(x) for x in o["logprobs"].tolist()] for o in twin_after.loss_fn_outputs
    ]
    out["default_config"] = dict(training.forward(datums, "stable_reinforce").result().metrics)

    first = datums[0]
    seq = sequences[0]
    tokens = list(seq.tokens)
    sid = seq.sequence_id

    def bad(**changes: Any) -> str | None:
        return error_text(
            lambda: training.forward([replace(first, **changes)], "stable_reinforce").result()
        )

    inputs = dict(first.loss_fn_inputs)
    advantages = inputs["advantages"].tolist()
    advantages[0] = 1.0  # a prompt position
    changed = list(tokens)
    changed[0] = (changed[0] + 1) % 20
    errors = {
        "no_provenance": error_text(
            lambda: training.forward(
                [plain_datum(tokens, [0.0] * len(tokens), 1.0)], "stable_reinforce"
            ).result()
        ),
        "unknown_id": error_text(
            lambda: training.forward(
                [
                    provenance(
                        plain_datum(tokens, [0.0] * len(tokens), 1.0),
                        len(PROMPT),
                        len(tokens),
                        "req_nope:0",
                    )
                ],
                "stable_reinforce",
            ).result()
        ),
        "input_differs": error_text(
            lambda: training.forward(
                [
                    provenance(
                        replace(
                            first, model_input=types.ModelInput.from_ints(PROMPT + changed[:-1])
                        ),
                        len(PROMPT),
                        len(tokens),
                        sid,
                    )
                ],
                "stable_reinforce",
            ).result()
        ),
        "target_differs": bad(
            loss_fn_inputs={**inputs, "target_tokens": [0] * (len(PROMPT) - 1) + changed}
        ),
        "advantage_on_prompt": bad(loss_fn_inputs={**inputs, "advantages": advantages}),
        "not_tiling": bad(
            model_input_spans=[types.SampledProvenanceSpan(sequence_id=sid, length=1)],
        ),
        "past_the_record": bad(
            loss_fn_input_spans=[
                types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=len(PROMPT) - 2),
                types.SampledProvenanceSpan(sequence_id=sid, length=len(tokens) + 1),
            ]
        ),
        "bad_truncation": error_text(
            lambda: training.forward(
                datums[:1], "stable_reinforce", loss_fn_config={"truncation": 0.0}
            ).result()
        ),
    }
    # records are the sampling Tinker session's: another session's id is unknown here
    other = tinker.ServiceClient()
    other_training = other.create_lora_training_client(base_model=base_model, rank=4, seed=0)
    other_sampler = other_training.save_weights_and_get_sampling_client(
        record_stability_info=True
    ).result()
    foreign = next(s for s in sample(other_sampler, seed=5) if len(s.tokens) >= 2)
    foreign_datum = provenance(
        plain_datum(list(foreign.tokens), list(foreign.logprobs or []), 1.0),
        len(PROMPT),
        len(foreign.tokens),
        foreign.sequence_id,
    )
    errors["foreign_id"] = error_text(
        lambda: training.forward([foreign_datum], "stable_reinforce").result()
    )
    errors["foreign_own_session"] = error_text(
        lambda: other_training.forward([foreign_datum], "stable_reinforce").result()
    )
    # a client that does not record: its sequences have no record
    unrecorded = training.save_weights_and_get_sampling_client().result()
    plain = next(s for s in sample(unrecorded, seed=6) if len(s.tokens) >= 2)
    errors["not_recorded"] = error_text(
        lambda: training.forward(
            [
                provenance(
                    plain_datum(list(plain.tokens), list(plain.logprobs or []), 1.0),
                    len(PROMPT),
                    len(plain.tokens),
                    plain.sequence_id,
                )
            ],
            "stable_reinforce",
        ).result()
    )
    out["errors"] = errors
    return out


if __name__ == "__main__":
    print_result(lambda: main(sys.argv[1]))
