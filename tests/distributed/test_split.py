"""The data-parallel split of a call's samples (pure: no process group)."""

from __future__ import annotations

import torch

from trainer.compute.batch import PreparedSample
from trainer.compute.rounds import split_by_tokens


def _samples(lengths: list[int]) -> list[PreparedSample]:
    out = []
    for i, n in enumerate(lengths):
        tokens = torch.zeros(n, dtype=torch.long)
        out.append(PreparedSample(i, tokens, tokens, torch.ones(n)))
    return out


def test_every_sample_goes_to_exactly_one_rank_in_call_order() -> None:
    shares = split_by_tokens(_samples([5, 1, 9, 3, 3, 7, 2]), world_size=3)
    indices = [s.index for share in shares for s in share]
    assert sorted(indices) == list(range(7))
    assert all([s.index for s in share] == sorted(s.index for s in share) for share in shares)


def test_tokens_are_balanced_longest_first() -> None:
    shares = split_by_tokens(_samples([8, 7, 6, 5, 4, 3, 2, 1]), world_size=2)
    assert [sum(s.length for s in share) for share in shares] == [18, 18]


def test_fewer_samples_than_ranks_leave_ranks_empty() -> None:
    shares = split_by_tokens(_samples([4, 2, 9]), world_size=4)
    assert [len(share) for share in shares] == [1, 1, 1, 0]
    assert shares[0][0].length == 9
