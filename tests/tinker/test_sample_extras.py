"""tinker 0.38's sampling extras through the official SDK (`sdk_scripts/sample_extras.py`
drives it; this side judges against a plain transformers forward), on a tied Qwen3-style and an
untied Llama-style model:

- `topk_sample_logprobs`: per sampled token the model's top k (raw logits), most likely first;
- `target_prompt_logprobs`: the logprobs of the named ids at their positions, 0.0 where a dense
  request has -1, and a sparse request answered sparse with its own row pointers and columns;
- `prompt_alt_tokens_k`: k draws per position after the first, each with the model's logprob
  there, the same again under the same seed;
- a top k the server refuses comes back as a 400 naming `topk_sample_logprobs`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.api.conftest import LiveServer
from tests.tinker.conftest import SCRIPTS, SDK_MODEL, UNTIED_MODEL, run_in_venv

MODELS = (SDK_MODEL, UNTIED_MODEL)


@pytest.fixture(scope="module")
def run(venv_python: Path, tinker_server: LiveServer) -> dict[str, Any]:
    argv = [str(SCRIPTS / "sample_extras.py"), *MODELS]
    return run_in_venv(venv_python, tinker_server, argv, timeout=300)


@torch.no_grad()
def _log_softmax(model_dir: Path, tokens: list[int]) -> np.ndarray:
    """[len(tokens) - 1, V]: row i the model's next-token logprobs after tokens[: i + 1]."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    logits = model(input_ids=torch.tensor([tokens])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1).numpy()


@pytest.mark.parametrize("name", MODELS)
def test_topk_sample_logprobs(
    run: dict[str, Any], served_models: dict[str, Path], name: str
) -> None:
    prompt, got = run["prompt"], run["models"][name]
    assert len(got["sequences"]) == 2
    for seq in got["sequences"]:
        ref = _log_softmax(served_models[name], prompt + seq["tokens"])[len(prompt) - 1 :]
        assert len(seq["topk"]) == len(seq["tokens"])
        for t, (token, row) in enumerate(zip(seq["tokens"], seq["topk"], strict=True)):
            order = np.argsort(-ref[t], kind="stable")[:3]
            assert [tid for tid, _ in row] == order.tolist()
            np.testing.assert_allclose([lp for _, lp in row], ref[t, order], atol=1e-4)
            assert seq["logprobs"][t] == pytest.approx(float(ref[t, token]), abs=1e-4)


@pytest.mark.parametrize("name", MODELS)
def test_target_prompt_logprobs_dense_and_sparse(
    run: dict[str, Any], served_models: dict[str, Path], name: str
) -> None:
    prompt, got = run["prompt"], run["models"][name]
    ref = _log_softmax(served_models[name], prompt)
    rows = len(prompt) - 1
    dense = got["dense"]
    assert dense["shape"] == [rows, 2] and dense["crow"] is None and dense["dtype"] == "float32"
    values = np.asarray(dense["data"]).reshape(rows, 2)
    for i, row in enumerate(got["dense_ids"]):
        for j, token in enumerate(row):
            expected = 0.0 if token == -1 else ref[i, token]
            assert values[i, j] == pytest.approx(float(expected), abs=1e-5), (i, j)
    sparse = got["sparse"]
    assert sparse["shape"] == [rows, 3]
    assert sparse["crow"] == [0, 0, 0, 0, 2, 2, 2, 2, 2, 3] and sparse["col"] == [0, 2, 1]
    np.testing.assert_allclose(sparse["data"], [ref[3, 5], ref[3, 17], ref[8, 1]], atol=1e-5)


@pytest.mark.parametrize("name", MODELS)
def test_prompt_alt_tokens(run: dict[str, Any], served_models: dict[str, Path], name: str) -> None:
    prompt, got = run["prompt"], run["models"][name]
    ref = _log_softmax(served_models[name], prompt)
    rows = len(prompt) - 1
    tokens, logprobs = got["alt_tokens"], got["alt_logprobs"]
    assert tokens["shape"] == [rows, 4] and logprobs["shape"] == [rows, 4]
    ids = np.asarray(tokens["data"], dtype=np.int64).reshape(rows, 4)
    lps = np.asarray(logprobs["data"]).reshape(rows, 4)
    np.testing.assert_allclose(lps, np.take_along_axis(ref, ids, axis=1), atol=1e-5)
    assert got["alt_again"]["data"] == tokens["data"]  # the request's seed: the same draws


def test_a_refused_top_k_names_its_field(run: dict[str, Any]) -> None:
    for name in MODELS:
        error = run["models"][name]["too_wide"]
        assert error is not None and error.startswith("BadRequestError"), error
        assert "topk_sample_logprobs" in error, error


def test_the_request_fields_are_checked_by_name() -> None:
    from trainer.api.tinker.convert import TinkerInputError, sample_body

    req = {"prompt": {"chunks": [{"tokens": [5, 6, 7]}]}, "sampling_params": {"max_tokens": 1}}

    def target(**fields: Any) -> dict[str, Any]:
        return {"data": [3, -1], "dtype": "int64", "shape": [2, 1], **fields}

    body = sample_body({**req, "target_prompt_logprobs": target(), "prompt_alt_tokens_k": 2})
    assert body["target_prompt_ids"] == [[[3], [-1]]] and body["prompt_alt_tokens_k"] == 2
    sparse = target(data=[4], sparse_crow_indices=[0, 0, 1], sparse_col_indices=[0])
    assert sample_body({**req, "target_prompt_logprobs": sparse})["target_prompt_ids"] == [
        [[-1], [4]]
    ]
    cases = [
        ({"target_prompt_logprobs": target(dtype="float32")}, "target_prompt_logprobs.dtype"),
        ({"target_prompt_logprobs": target(shape=[3, 1])}, "target_prompt_logprobs.shape"),
        ({"target_prompt_logprobs": target(data=[-1, -1])}, "target_prompt_logprobs"),
        ({"target_prompt_logprobs": target(data=[3, -7])}, "target_prompt_logprobs[1][0]"),
        (
            {"target_prompt_logprobs": {**sparse, "sparse_crow_indices": [0, 1]}},
            "target_prompt_logprobs.sparse_crow_indices",
        ),
        ({"prompt_alt_tokens_k": 21}, "prompt_alt_tokens_k"),
        ({"topk_sample_logprobs": -1}, "topk_sample_logprobs"),
    ]
    for change, field in cases:
        with pytest.raises(TinkerInputError) as info:
            sample_body({**req, **change})
        assert info.value.field == field, (change, info.value)
