"""Sampling extras, checked against a plain transformers forward of prompt + generated tokens:

- `top_logprobs`: per generated token, the model's k most likely ids and logprobs (raw
  logits: no temperature, top-k or top-p);
- `sampling_logprobs`: each token's logprob under the distribution it was drawn from
  (temperature, then top-k, then top-p, applied here by a naive formula; 0.0 greedy);
- `target_prompt_ids` / `prompt_alt_tokens_k`: the prompt side (logprobs of named ids at
  given positions; draws from each position's distribution);
- a `SampleWatch` that stops one job of a batch: its rows keep their tokens, its neighbour's
  tokens equal a run alone.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.engine.helpers import make_resource, model_input
from trainer.compute import sampler
from trainer.contract.errors import OperationError
from trainer.contract.specs import LoraConfig, SamplingParams, SessionSpec

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13]]


def _plain(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def _reference_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int]):
    """[len(tokens), V] raw log-softmax at the positions that predict `tokens`, and the raw
    logits there."""
    ids = torch.tensor([prompt + tokens])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1), logits


def _naive_sampling_logprob(
    logits: torch.Tensor, token: int, temperature: float, top_k: int, top_p: float
) -> float:
    """The drawn-from distribution's logprob of `token`, one position, by plain loops:
    divide by the temperature, keep the top_k largest, then the smallest most-likely set whose
    mass reaches top_p (a token is kept while the mass before it is at most top_p)."""
    scaled = [float(v) / temperature for v in logits]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    keep = set(order[:top_k] if top_k > 0 else order)
    peak = max(scaled[i] for i in keep)
    weights = {i: math.exp(scaled[i] - peak) for i in keep}
    total = sum(weights.values())
    mass, nucleus = 0.0, set()
    for i in order:
        if i not in keep:
            continue
        if mass > top_p:
            break
        nucleus.add(i)
        mass += weights[i] / total
    if token not in nucleus:
        return float("-inf")
    return math.log(weights[token] / sum(weights[i] for i in nucleus))


def _session(model_dir: Path, tmp_path: Path, name: str = "a"):
    resource = make_resource(model_dir, tmp_path)
    return resource.create_session(name, SessionSpec(lora_config=LoraConfig(seed=3)))


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(0.7, 6, 0.9), (1.3, -1, 0.8), (1.0, 3, 1.0)]
)
def test_top_and_sampling_logprobs_match_a_reference(
    tiny_model_dir: Path, tmp_path: Path, temperature: float, top_k: int, top_p: float
) -> None:
    session = _session(tiny_model_dir, tmp_path)  # a fresh adapter: the base weights
    params = SamplingParams(
        max_tokens=6, seed=2, temperature=temperature, top_k=top_k, top_p=top_p, top_logprobs=4
    )
    out = session.sample(
        [model_input(p) for p in PROMPTS],
        num_samples=2,
        sampling_params=params,
        sampling_logprobs=True,
    )
    plain = _plain(tiny_model_dir)
    for prompt, result in zip(PROMPTS, out["results"], strict=True):
        for seq in result["sequences"]:
            tokens = seq["tokens"]
            ref, logits = _reference_logprobs(plain, prompt, tokens)
            chosen = ref.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)
            torch.testing.assert_close(torch.tensor(seq["logprobs"]), chosen, atol=1e-4, rtol=0)
            assert len(seq["top_logprobs"]) == len(tokens)
            for t, top in enumerate(seq["top_logprobs"]):
                values, ids = torch.topk(ref[t], 4)
                assert top["token_ids"] == ids.tolist()
                torch.testing.assert_close(torch.tensor(top["logprobs"]), values, atol=1e-4, rtol=0)
            expected = [
                _naive_sampling_logprob(logits[t], tok, temperature, top_k, top_p)
                for t, tok in enumerate(tokens)
            ]
            assert all(math.isfinite(v) for v in expected)  # every drawn token was allowed
            torch.testing.assert_close(
                torch.tensor(seq["sampling_logprobs"]), torch.tensor(expected), atol=1e-4, rtol=0
            )


def test_greedy_sampling_logprobs_are_zero_and_extras_absent_unless_asked(
    tiny_qwen_dir: Path, tmp_path: Path
) -> None:
    session = _session(tiny_qwen_dir, tmp_path)
    greedy = SamplingParams(max_tokens=5, temperature=0.0, top_logprobs=2)
    (result,) = session.sample(
        [model_input(PROMPTS[0])], sampling_params=greedy, sampling_logprobs=True
    )["results"]
    (seq,) = result["sequences"]
    assert seq["sampling_logprobs"] == [0.0] * len(seq["tokens"])
    assert [top["token_ids"][0] for top in seq["top_logprobs"]] == seq["tokens"]
    (plain_result,) = session.sample(
        [model_input(PROMPTS[0])], sampling_params=SamplingParams(max_tokens=5, temperature=0.0)
    )["results"]
    (plain_seq,) = plain_result["sequences"]
    assert "sampling_logprobs" not in plain_seq and "top_logprobs" not in plain_seq
    assert plain_seq["tokens"] == seq["tokens"] and plain_seq["logprobs"] == seq["logprobs"]
    for bad in (-1, 21):
        with pytest.raises(ValueError, match="top_logprobs"):
            SamplingParams(top_logprobs=bad)


def test_prompt_targets_and_alternative_draws(tiny_model_dir: Path, tmp_path: Path) -> None:
    session = _session(tiny_model_dir, tmp_path)
    prompt = [4, 8, 15, 16, 23, 42]
    targets = [[-1, -1], [3, -1], [-1, -1], [7, 100], [15, -1]]  # rows: positions 1..5
    params = SamplingParams(max_tokens=1, seed=11, temperature=0.8)
    (result,) = session.sample(
        [model_input(prompt)],
        sampling_params=params,
        target_prompt_ids=[targets],
        prompt_alt_tokens_k=3,
    )["results"]
    plain = _plain(tiny_model_dir)
    with torch.no_grad():
        ref = torch.log_softmax(plain(input_ids=torch.tensor([prompt])).logits[0, :-1], dim=-1)
    got = result["target_prompt_logprobs"]
    assert len(got) == len(prompt) - 1
    for i, row in enumerate(targets):
        for j, token in enumerate(row):
            if token == -1:
                assert got[i][j] is None
            else:
                assert got[i][j] == pytest.approx(float(ref[i, token]), abs=1e-5)
    alt = result["prompt_alt_tokens"]
    assert len(alt["token_ids"]) == len(prompt) - 1
    for i, (ids, lps) in enumerate(zip(alt["token_ids"], alt["logprobs"], strict=True)):
        assert len(ids) == 3
        torch.testing.assert_close(torch.tensor(lps), ref[i, ids], atol=1e-5, rtol=0)
    # seeded: the same draws again; greedy: the argmax at every position
    (again,) = session.sample([model_input(prompt)], sampling_params=params, prompt_alt_tokens_k=3)[
        "results"
    ]
    assert again["prompt_alt_tokens"] == alt
    (greedy,) = session.sample(
        [model_input(prompt)],
        sampling_params=SamplingParams(max_tokens=1, temperature=0.0),
        prompt_alt_tokens_k=2,
    )["results"]
    argmax = ref.argmax(-1).tolist()
    assert greedy["prompt_alt_tokens"]["token_ids"] == [[a, a] for a in argmax]


def test_prompt_side_refusals_name_the_field(tiny_qwen_dir: Path, tmp_path: Path) -> None:
    session = _session(tiny_qwen_dir, tmp_path)
    prompt = [model_input([4, 8, 15])]
    cases = [
        ({"target_prompt_ids": [[[1]]]}, "target_prompt_ids[0]"),  # one row for two positions
        ({"target_prompt_ids": [[[-1], [-1]]]}, "target_prompt_ids[0]"),  # nothing asked
        ({"target_prompt_ids": [[[1], [999]]]}, "target_prompt_ids[0][1][0]"),  # out of vocab
        ({"prompt_alt_tokens_k": 21}, "prompt_alt_tokens_k"),
    ]
    for kwargs, field in cases:
        with pytest.raises(OperationError) as info:
            session.sample(prompt, **kwargs)
        assert info.value.field == field, (kwargs, info.value)


class StopAfter:
    """A watch that says stop once `steps` decode steps have run, and records what it saw."""

    def __init__(self, steps: int) -> None:
        self.steps, self.seen = steps, 0
        self.lengths: list[list[int]] = []

    def stopped(self) -> bool:
        return self.seen >= self.steps

    def step(self, sequences: list[sampler.Sequence]) -> None:
        self.seen += 1
        self.lengths.append([len(s.tokens) for s in sequences])


class Broken:
    def stopped(self) -> bool:
        return False

    def step(self, sequences: list[sampler.Sequence]) -> None:
        raise RuntimeError("consumer gone")


def _job(prompts: list[list[int]], seed: int, watch=None) -> sampler.DecodeJob:
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=seed)
    return sampler.DecodeJob(
        prompts=prompts, num_samples=2, params=params, eos_ids=set(), seed=seed, watch=watch
    )


@torch.no_grad()
def test_a_watch_stops_its_job_and_leaves_its_neighbour_alone(tiny_model_dir: Path) -> None:
    model = _plain(tiny_model_dir)
    (alone,) = sampler.generate(model, [_job([PROMPTS[1]], seed=5)])
    _, unwatched = sampler.generate(model, [_job([PROMPTS[0]], seed=4), _job([PROMPTS[1]], seed=5)])
    watch = StopAfter(3)
    told: dict[int, tuple] = {}
    stopped, neighbour = sampler.generate(
        model,
        [_job([PROMPTS[0]], seed=4, watch=watch), _job([PROMPTS[1]], seed=5)],
        report=lambda job, groups, error: told.setdefault(job, (groups, error)),
    )
    assert neighbour == unwatched  # the same batch unwatched: bit for bit
    for seq, solo in zip(neighbour[0], alone[0], strict=True):  # alone: the same tokens
        assert seq.tokens == solo.tokens and seq.stop_reason == solo.stop_reason
        torch.testing.assert_close(seq.logprobs, solo.logprobs, atol=1e-5, rtol=0)
    assert watch.lengths == [[1, 1], [2, 2], [3, 3]]  # told after each step
    for seq in stopped[0]:
        assert len(seq.tokens) == 3 and seq.stop_reason == sampler.STOP_CANCELLED
    (solo_watched,) = sampler.generate(model, [_job([PROMPTS[0]], seed=4)])
    for cut, full in zip(stopped[0], solo_watched[0], strict=True):
        assert cut.tokens == full.tokens[:3]  # what it had when stopped
    assert told[0][1] is None and told[1][1] is None


@torch.no_grad()
def test_a_watch_that_raises_fails_its_job_alone(tiny_qwen_dir: Path) -> None:
    model = _plain(tiny_qwen_dir)
    _, unwatched = sampler.generate(model, [_job([PROMPTS[0]], seed=4), _job([PROMPTS[1]], seed=5)])
    told: dict[int, OperationError | None] = {}
    _, neighbour = sampler.generate(
        model,
        [_job([PROMPTS[0]], seed=4, watch=Broken()), _job([PROMPTS[1]], seed=5)],
        report=lambda job, groups, error: told.setdefault(job, error),
    )
    assert neighbour == unwatched
    assert told[1] is None
    assert told[0] is not None and "consumer gone" in told[0].message
    with pytest.raises(OperationError, match="consumer gone"):  # alone, without a report
        sampler.generate(model, [_job([PROMPTS[0]], seed=4, watch=Broken())])


def test_a_session_sample_with_a_watch(tiny_qwen_dir: Path, tmp_path: Path) -> None:
    session = _session(tiny_qwen_dir, tmp_path)
    params = SamplingParams(max_tokens=8, seed=1)
    full = session.sample([model_input(PROMPTS[0])], num_samples=2, sampling_params=params)
    watch = StopAfter(2)
    cut = session.sample(
        [model_input(PROMPTS[0])], num_samples=2, sampling_params=params, watch=watch
    )
    for short, long in zip(
        cut["results"][0]["sequences"], full["results"][0]["sequences"], strict=True
    ):
        assert short["stop_reason"] == sampler.STOP_CANCELLED
        assert short["tokens"] == long["tokens"][:2]
        assert short["logprobs"] == long["logprobs"][:2]
    pre = StopAfter(0)  # stopped before the first token
    out = session.sample([model_input(PROMPTS[0])], sampling_params=params, watch=pre)
    assert out["results"][0]["sequences"][0]["tokens"] == []
    assert pre.lengths == []
