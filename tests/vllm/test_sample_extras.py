"""Sampling extras on vLLM replicas, against the in-process twin at the same weights:
`top_logprobs` (vLLM's raw `logprobs=k`: the same ids, values within 1e-3), `sampling_logprobs`
where vLLM's answer is exact (greedy: 0.0; temperature 1, no top-k/top-p: the model's own) and
a 400 naming the field elsewhere, the prompt side (computed by the worker, as in-process), and
a watch (told each engine step's new tokens; a stop cancels the rows on the replica)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.helpers import model_input
from tests.vllm.test_engine import _resource, _session
from trainer.compute import sampler
from trainer.contract.errors import OperationError
from trainer.contract.specs import SamplingParams

PROMPTS = [[2, 3, 4], [5, 6, 7, 8, 9]]
TOL = 1e-3


@pytest.fixture(scope="module")
def pair(vllm_model: Path, vllm_py: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("extras-pair")
    served = _resource(vllm_model, root / "vllm", vllm_py, max_loras=3)
    twin = _resource(vllm_model, root / "hf", None)
    yield _session(served, "x"), _session(twin, "x")
    served.close()
    twin.close()


def _run(session: Any, **kwargs: Any) -> dict[str, Any]:
    params = SamplingParams(**{"max_tokens": 6, "temperature": 0.0, **kwargs.pop("params", {})})
    return session.sample([model_input(p) for p in PROMPTS], sampling_params=params, **kwargs)


def _seqs(out: dict[str, Any]) -> list[dict[str, Any]]:
    return [seq for result in out["results"] for seq in result["sequences"]]


def test_top_logprobs_and_greedy_sampling_logprobs(pair: Any) -> None:
    served, twin = pair
    kwargs = {"params": {"top_logprobs": 3}, "sampling_logprobs": True}
    got, want = _run(served, **kwargs), _run(twin, **kwargs)
    for g, w in zip(_seqs(got), _seqs(want), strict=True):
        assert g["tokens"] == w["tokens"]
        assert g["sampling_logprobs"] == [0.0] * len(g["tokens"])
        assert [t["token_ids"] for t in g["top_logprobs"]] == [
            t["token_ids"] for t in w["top_logprobs"]
        ]
        for gt, wt in zip(g["top_logprobs"], w["top_logprobs"], strict=True):
            torch.testing.assert_close(
                torch.tensor(gt["logprobs"]), torch.tensor(wt["logprobs"]), atol=TOL, rtol=0
            )


def test_sampling_logprobs_exact_or_refused(pair: Any) -> None:
    served, _ = pair
    out = _run(served, params={"temperature": 1.0, "seed": 3}, sampling_logprobs=True)
    for seq in _seqs(out):
        assert seq["sampling_logprobs"] == seq["logprobs"]
    with pytest.raises(OperationError) as info:
        _run(served, params={"temperature": 0.7}, sampling_logprobs=True)
    assert info.value.field == "sampling_logprobs"


def test_a_watch_on_vllm(pair: Any) -> None:
    served, _ = pair

    class Watch:
        def __init__(self, stop: bool) -> None:
            self.stop, self.told = stop, []

        def stopped(self) -> bool:
            return self.stop

        def step(self, sequences: list[sampler.Sequence]) -> None:
            self.told.append([len(s.tokens) for s in sequences])

    done = Watch(False)
    out = _run(served, watch=done, params={"max_tokens": 24})
    final = [len(s["tokens"]) for s in _seqs(out)]
    assert final == [24, 24] and done.told[-1] == final
    assert len(done.told) > 2  # told as the tokens come, not once at the end
    for before, after in zip(done.told, done.told[1:]):
        assert all(a >= b for a, b in zip(after, before, strict=True)), done.told
    early = Watch(True)
    out = _run(served, watch=early)
    assert all(s["tokens"] == [] and s["stop_reason"] == sampler.STOP_CANCELLED for s in _seqs(out))


def test_a_watch_that_says_stop_cancels_the_rows_on_the_replica(pair: Any) -> None:
    served, _ = pair
    whole = _run(served, params={"max_tokens": 200})

    class StopAfter:
        """Says stop once every row has 3 tokens; records what it was told."""

        def __init__(self) -> None:
            self.told: list[list[list[int]]] = []

        def stopped(self) -> bool:
            return bool(self.told) and all(len(row) >= 3 for row in self.told[-1])

        def step(self, sequences: list[sampler.Sequence]) -> None:
            self.told.append([list(s.tokens) for s in sequences])

    watch = StopAfter()
    out = _run(served, watch=watch, params={"max_tokens": 200})
    for got, want in zip(_seqs(out), _seqs(whole), strict=True):
        made = len(got["tokens"])
        assert 3 <= made < 200, made  # stopped early, keeping what it made
        assert got["stop_reason"] == sampler.STOP_CANCELLED
        assert got["tokens"] == want["tokens"][:made]  # greedy: the same tokens, cut short
        torch.testing.assert_close(
            torch.tensor(got["logprobs"]), torch.tensor(want["logprobs"][:made]), atol=0, rtol=0
        )
    # each step's tokens are a prefix of the final ones
    for step in watch.told[:-1]:
        for row, seq in zip(step, _seqs(out), strict=True):
            assert seq["tokens"][: len(row)] == row
    # the replica serves on, its rows freed
    again = _run(served, params={"max_tokens": 6})
    assert [s["tokens"] for s in _seqs(again)] == [s["tokens"][:6] for s in _seqs(whole)]
    pool = served.resource.replicas
    assert pool is not None and all(r.rows_in_flight == 0 for r in pool.replicas)
