"""The server's capabilities and `prompt_logprobs_last_n`, through the official SDK (run by the
tinker venv's python).

Usage: python logprobs_last_n.py BASE_MODEL
Env: TINKER_BASE_URL, TINKER_API_KEY (the SDK reads them).

Reads `RestClient.get_server_capabilities()`; then, on a sampling client of BASE_MODEL, the
prompt logprobs of one prompt whole (`compute_logprobs`) and of its last N tokens for a few N
(`compute_logprobs(..., prompt_logprobs_last_n=N)`, and `sample` with top-k prompt logprobs),
which the SDK itself checks were honored (`_check_prompt_logprobs_last_n_honored`); and what it
raises for an N the server refuses (N = len(prompt)). Prints one JSON object; the pytest side
judges (tests/tinker/test_capabilities_and_last_n.py).
"""

from __future__ import annotations

import sys
from typing import Any

import tinker
from tinker import types

from tests.tinker.sdk_scripts.report import print_result

PROMPT = [6, 9, 12, 7, 20, 8, 15, 11, 30, 10]
LAST_N = (1, 4, len(PROMPT) - 1)
TOPK = 3


def error_of(fn: Any) -> str | None:
    try:
        fn()
    except Exception as exc:  # we report what the SDK raised
        return f"{type(exc).__name__}: {exc}"
    return None


def main(base_model: str) -> dict[str, Any]:
    service = tinker.ServiceClient()
    caps = service.create_rest_client().get_server_capabilities().result()
    out: dict[str, Any] = {"capabilities": [m.model_dump() for m in caps.supported_models]}
    sampler = service.create_sampling_client(base_model=base_model)
    prompt = types.ModelInput.from_ints(PROMPT)
    out["full"] = sampler.compute_logprobs(prompt).result()
    out["last_n"] = {
        str(n): sampler.compute_logprobs(prompt, prompt_logprobs_last_n=n).result() for n in LAST_N
    }
    params = types.SamplingParams(max_tokens=1, seed=0)
    full = sampler.sample(prompt, 1, params, True, TOPK).result()
    out["topk_full"] = full.topk_prompt_logprobs
    suffix = sampler.sample(prompt, 1, params, True, TOPK, prompt_logprobs_last_n=4).result()
    out["topk_last_4"] = suffix.topk_prompt_logprobs
    out["sample_last_4"] = suffix.prompt_logprobs
    out["too_long"] = error_of(
        lambda: sampler.compute_logprobs(prompt, prompt_logprobs_last_n=len(PROMPT)).result()
    )
    return out


if __name__ == "__main__":
    print_result(lambda: main(sys.argv[1]))
