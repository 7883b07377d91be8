"""tinker 0.38's sampling extras through the official SDK (run by the tinker venv's python):
`topk_sample_logprobs`, `target_prompt_logprobs` (dense and sparse CSR) and
`prompt_alt_tokens_k`, on a sampling client of each BASE_MODEL given.

Usage: python sample_extras.py BASE_MODEL [BASE_MODEL ...]
Env: TINKER_BASE_URL, TINKER_API_KEY (the SDK reads them).

Prints one JSON object, per model what came back (raw tensor fields: data, shape, CSR
indices); the pytest side judges against a reference forward (tests/tinker/test_sample_extras.py).
"""

from __future__ import annotations

import sys
from typing import Any

import tinker
from tinker import types

from tests.tinker.sdk_scripts.report import error_text, print_result

PROMPT = [6, 9, 12, 7, 20, 8, 15, 11, 30, 10]
TOPK = 3
ALT_K = 4


def tensor(data: Any) -> dict[str, Any] | None:
    if data is None:
        return None
    return {
        "data": [float(v) for v in data.data],
        "dtype": data.dtype,
        "shape": data.shape,
        "crow": data.sparse_crow_indices,
        "col": data.sparse_col_indices,
    }


def one_model(service: tinker.ServiceClient, base_model: str) -> dict[str, Any]:
    sampler = service.create_sampling_client(base_model=base_model)
    prompt = types.ModelInput.from_ints(PROMPT)
    rows = len(PROMPT) - 1
    params = types.SamplingParams(max_tokens=5, seed=3, temperature=0.9, top_k=20)
    topk = sampler.sample(prompt, 2, params, topk_sample_logprobs=TOPK).result()
    dense_ids = [
        [(7 * i + 3 * j) % 30 if (i + j) % 3 else -1 for j in range(2)] for i in range(rows)
    ]
    dense = types.TensorData(data=[t for r in dense_ids for t in r], dtype="int64", shape=[rows, 2])
    # sparse: position 4 (row 3) asks ids 5 and 17 in columns 0 and 2; position 9 (row 8) id 1
    sparse = types.TensorData(
        data=[5, 17, 1],
        dtype="int64",
        shape=[rows, 3],
        sparse_crow_indices=[0, 0, 0, 0, 2, 2, 2, 2, 2, 3],
        sparse_col_indices=[0, 2, 1],
    )
    one = types.SamplingParams(max_tokens=1, seed=7, temperature=0.8)
    got_dense = sampler.sample(prompt, 1, one, target_prompt_logprobs=dense).result()
    got_sparse = sampler.sample(prompt, 1, one, target_prompt_logprobs=sparse).result()
    alts = sampler.sample(prompt, 1, one, prompt_alt_tokens_k=ALT_K).result()
    alts_again = sampler.sample(prompt, 1, one, prompt_alt_tokens_k=ALT_K).result()
    assert alts.prompt_alt_tokens is not None and alts_again.prompt_alt_tokens is not None
    return {
        "sequences": [
            {"tokens": s.tokens, "logprobs": s.logprobs, "topk": s.topk_logprobs}
            for s in topk.sequences
        ],
        "dense_ids": dense_ids,
        "dense": tensor(got_dense.target_prompt_logprobs),
        "sparse": tensor(got_sparse.target_prompt_logprobs),
        "alt_tokens": tensor(alts.prompt_alt_tokens.tokens),
        "alt_logprobs": tensor(alts.prompt_alt_tokens.logprobs),
        "alt_again": tensor(alts_again.prompt_alt_tokens.tokens),
        "too_wide": error_text(
            lambda: sampler.sample(prompt, 1, one, topk_sample_logprobs=21).result()
        ),
    }


def main(models: list[str]) -> dict[str, Any]:
    service = tinker.ServiceClient()
    return {"prompt": PROMPT, "models": {m: one_model(service, m) for m in models}}


if __name__ == "__main__":
    print_result(lambda: main(sys.argv[1:]))
