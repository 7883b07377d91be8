"""Group-normalised advantages against an independent torch formula."""

from __future__ import annotations

import pytest
import torch

from trainer.rl.advantages import (
    batch_advantages,
    group_advantages,
    is_degenerate,
    position_advantages,
)


def _reference(rewards: list[float], scale: bool) -> list[float]:
    r = torch.tensor(rewards, dtype=torch.float64)
    centred = r - r.mean()
    return (centred / (r.std(unbiased=False) + 1e-6) if scale else centred).tolist()


@pytest.mark.parametrize("scale", [True, False])
def test_group_matches_reference(scale: bool) -> None:
    rewards = [0.0, 0.25, 1.0, 0.5, 0.5, 0.75]
    assert group_advantages(rewards, scale) == pytest.approx(_reference(rewards, scale))


def test_group_properties() -> None:
    adv = group_advantages([1.0, 0.0, 0.0, 0.0])
    assert sum(adv) == pytest.approx(0.0, abs=1e-9)
    assert adv[0] == pytest.approx(3**0.5, rel=1e-4)  # (1 - 0.25) / sqrt(0.1875)
    assert adv[1:] == pytest.approx([-(1 / 3**0.5)] * 3, rel=1e-4)
    assert group_advantages([]) == []


def test_equal_rewards_carry_no_signal() -> None:
    for rewards in ([0.0] * 8, [1.0] * 8, [0.3]):
        adv = group_advantages(rewards)
        assert adv == [0.0] * len(rewards)
        assert is_degenerate(adv)
    assert not is_degenerate([[0.0, 0.1]])


def test_batch_is_per_group() -> None:
    groups = [[0.0, 1.0], [5.0, 5.0, 5.0], [0.2, 0.4, 0.9]]
    out = batch_advantages(groups)
    assert [len(g) for g in out] == [2, 3, 3]
    assert out[0] == pytest.approx([-1.0, 1.0], rel=1e-5)
    assert out[1] == [0.0, 0.0, 0.0]
    assert out[2] == pytest.approx(_reference(groups[2], True))


def test_position_advantages_normalise_each_position() -> None:
    scores = [[1.0, 0.0, 1.0], [0.0, 0.0, 1.0], [1.0, 1.0]]  # last one stopped early
    out = position_advantages(scores)
    assert [len(a) for a in out] == [3, 3, 2]
    col0 = _reference([1.0, 0.0, 1.0], True)
    col1 = _reference([0.0, 0.0, 1.0], True)
    col2 = _reference([1.0, 1.0, 0.0], True)  # the short completion counts as 0 there
    assert [a[0] for a in out] == pytest.approx(col0)
    assert [a[1] for a in out] == pytest.approx(col1)
    assert [out[0][2], out[1][2]] == pytest.approx(col2[:2])
    assert position_advantages([]) == []
