"""The decode loop stays on the device: one copy to the host per decode step for the whole
batch, and token draws that equal `torch.multinomial`'s for the same seed.

The copies are counted on the CPU by the host-crossing entry points (`benchmarks/
host_transfers.py`) during a real generation: several jobs (one on a LoRA adapter, one whose
adapter is NaN and fails alone), padded prompts, top-k and top-p, `sampling_logprobs`,
`top_logprobs`, a stop check (what a stop string becomes) and EOS ids.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from benchmarks.host_transfers import HostTransfers
from trainer.compute import draws, sampler
from trainer.compute.attention import use_packed_sdpa
from trainer.contract.errors import OperationError
from trainer.contract.specs import SamplingParams


def _model_with_adapters(model_dir: Path) -> torch.nn.Module:
    """The tiny model as the worker loads it (`packed_sdpa`), with LoRA adapters `good` (B = 0:
    the base weights) and `bad` (NaN)."""
    from peft import LoraConfig, get_peft_model

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    use_packed_sdpa(model)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    peft_model = get_peft_model(model, config, adapter_name="good")
    peft_model.add_adapter("bad", config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if ".bad." in name:
                param.fill_(float("nan"))
    return peft_model.base_model.model.eval()


def _jobs(tokens: int) -> list[sampler.DecodeJob]:
    def params(**kw: float) -> SamplingParams:
        return SamplingParams(max_tokens=tokens, seed=1, **kw)

    def repeats(seq: list[int]) -> bool:  # a stop check on the tokens so far
        return len(seq) > 1 and seq[-1] == seq[-2]

    return [
        sampler.DecodeJob(
            prompts=[[5, 6, 7], [9, 10, 11, 12, 13]],
            num_samples=2,
            params=params(temperature=0.8, top_k=6, top_p=0.9, top_logprobs=3),
            eos_ids={1},
            seed=11,
            stop_hit=repeats,
            adapter="good",
            sampling_logprobs=True,
        ),
        sampler.DecodeJob(
            prompts=[[4, 8, 15]],
            num_samples=3,
            params=params(temperature=1.0),
            eos_ids=set(),
            seed=12,
            adapter="bad",
        ),
        sampler.DecodeJob(
            prompts=[[16, 23, 42, 2]],
            num_samples=2,
            params=params(temperature=1.2, top_p=0.8, top_logprobs=2),
            eos_ids=set(),
            seed=13,
            sampling_logprobs=True,
        ),
        sampler.DecodeJob(
            prompts=[[3, 3]],
            num_samples=1,
            params=params(temperature=0.0, top_logprobs=1),
            eos_ids=set(),
            seed=14,
        ),
    ]


@torch.no_grad()
def test_one_host_copy_per_decode_step_for_the_whole_batch(tiny_qwen_dir: Path) -> None:
    model = _model_with_adapters(tiny_qwen_dir)
    told: dict[int, OperationError | None] = {}
    with HostTransfers(trace=True) as transfers:
        groups = sampler.generate(
            model,
            _jobs(tokens=12),
            forward=transfers.stepping(model),
            report=lambda job, _groups, error: told.setdefault(job, error),
        )
    assert transfers.steps >= 10  # the longest job ran (nearly) to max_tokens
    assert transfers.per_step[0] == 0  # nothing before the first forward
    assert max(transfers.per_step) <= 1, (transfers.per_step, transfers.where)
    assert transfers.total == transfers.steps  # one each step
    # what was generated is what the host copy says: the NaN job alone failed
    assert told[1] is not None and told[1].code == "NON_FINITE_LOSS"
    assert [told[i] for i in (0, 2, 3)] == [None, None, None]
    assert all(not seq.tokens for seq in groups[1][0])
    for seq in [s for group in groups[0] for s in group]:
        assert seq.tokens and len(seq.sampling_logprobs) == len(seq.tokens)
        assert all(len(top["token_ids"]) == 3 for top in seq.top_logprobs)
    (greedy,) = groups[3][0]
    assert [top["token_ids"][0] for top in greedy.top_logprobs] == greedy.tokens


@torch.no_grad()
def test_the_counter_sees_the_old_kinds_of_crossing() -> None:
    """The entry points the test above relies on: a read of one value, a list, a copy."""
    values = torch.tensor([1.0, float("nan")])
    with HostTransfers() as transfers:
        bool(torch.isfinite(values).all())
        values.tolist()
        values.cpu()
        float(values[0])
        values[0].item()
    assert transfers.total == 5 and transfers.steps == 0


def _multinomial_choose(
    logits_S_V: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> torch.Tensor:
    """The reference: the same temperature, top-k and top-p, then `torch.multinomial`."""
    if params.temperature == 0.0:
        return logits_S_V.argmax(-1)
    logits = logits_S_V / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(-1) - probs > params.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "vocab"),
    [
        (1.0, 0, 1.0, 128),
        (0.7, 6, 0.9, 128),
        (1.3, -1, 0.8, 128),
        (0.3, 50, 0.95, 128),
        (2.0, 2, 1.0, 128),
        (0.0, 0, 1.0, 128),
        (1.0, 0, 1.0, 151_936),  # Qwen3's vocabulary
        (0.8, 20, 0.95, 151_936),
    ],
)
def test_the_draw_equals_torch_multinomial_bit_for_bit_on_cpu(
    temperature: float, top_k: int, top_p: float, vocab: int
) -> None:
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    ours, theirs = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    data = torch.Generator().manual_seed(vocab)
    for _ in range(6):  # consecutive steps: the generators' states stay in step too
        logits = torch.randn(5, vocab, generator=data) * 4
        chosen, drawn_from = draws._choose(logits, params, ours)
        assert torch.equal(chosen, _multinomial_choose(logits, params, theirs))
        assert (drawn_from is None) == (temperature == 0.0)
    assert torch.equal(ours.get_state(), theirs.get_state())
