"""Group-normalised advantages (GRPO), as pure functions on plain lists.

Letters: P = prompts in a batch, G = completions per prompt (the group), T = completion tokens.

GRPO's baseline is the group: each completion is compared with its siblings from the same
prompt, `A_i = (r_i − mean_G(r)) / (std_G(r) + eps)` (population std; dividing by the std is
optional, as in Dr. GRPO). A group whose rewards are all equal carries no signal: every
advantage is 0 and its samples can be skipped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

EPS = 1e-6


def group_advantages(
    rewards_G: Sequence[float], scale_by_std: bool = True, eps: float = EPS
) -> list[float]:
    """Advantages of one group: reward minus the group mean, optionally over the group std."""
    if not rewards_G:
        return []
    mean = sum(rewards_G) / len(rewards_G)
    centred = [r - mean for r in rewards_G]
    if not scale_by_std:
        return centred
    std = math.sqrt(sum(c * c for c in centred) / len(centred))
    return [c / (std + eps) for c in centred]


def batch_advantages(
    rewards_P_G: Sequence[Sequence[float]], scale_by_std: bool = True, eps: float = EPS
) -> list[list[float]]:
    """`group_advantages` for every prompt of a batch (groups may differ in size)."""
    return [group_advantages(group, scale_by_std, eps) for group in rewards_P_G]


def position_advantages(
    scores_G_T: Sequence[Sequence[float]], scale_by_std: bool = True, eps: float = EPS
) -> list[list[float]]:
    """Per-token advantages: each position is normalised across the group on its own.

    `scores_G_T[i][t]` scores completion i's token t. Completions may differ in length; a
    completion that stopped before position t counts as a 0 there for the baseline, and gets
    no advantage for positions it does not have.
    """
    if not scores_G_T:
        return []
    width = max(len(s) for s in scores_G_T)
    columns = [[s[t] if t < len(s) else 0.0 for s in scores_G_T] for t in range(width)]
    normed_T_G = [group_advantages(column, scale_by_std, eps) for column in columns]
    return [[normed_T_G[t][i] for t in range(len(s))] for i, s in enumerate(scores_G_T)]


def is_degenerate(advantages: Sequence[float] | Sequence[Sequence[float]]) -> bool:
    """True when every advantage is (numerically) 0: the group teaches nothing."""
    flat: list[float] = []
    for a in advantages:
        flat.extend(a if isinstance(a, Sequence) else [a])
    return all(abs(a) < 1e-9 for a in flat)
