"""Hybrid, sliding-window and sink families sharded with FSDP2 on two CPU ranks: a LoRA
session's multi-sample forward and its samples equal a plain eager forward of each sequence
alone (docs/semantics.md §20: the layout each family's layers call for, under torchrun too)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.launch import two_rank_case
from tests.distributed.scenario import FAMILY_PROMPTS
from tests.models.conformance import plain, save, sequence_logprobs

pytestmark = pytest.mark.distributed

FAMILIES = {"qwen3_5": "rows", "gemma3": "packed", "gpt_oss": "rows"}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    work = tmp_path_factory.mktemp("families-sharded")
    models = work / "models"
    for family in FAMILIES:
        save(family, models / family)
    return models, two_rank_case("families", models, work / "storage", work)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sharded_forward_and_samples_equal_each_sequence_alone(
    sharded: tuple[Path, dict[str, Any]], family: str
) -> None:
    models, result = sharded
    got = result[family]
    assert got["layout"] == FAMILIES[family]
    reference = plain(models / family)
    with torch.no_grad():
        for tokens, targets, logprobs in zip(
            got["tokens"], got["targets"], got["logprobs"], strict=True
        ):
            want = sequence_logprobs(reference, tokens, [int(t) for t in targets])
            torch.testing.assert_close(torch.tensor(logprobs), want, atol=1e-4, rtol=0)
        for prompt, seq in zip(FAMILY_PROMPTS, got["sampled"], strict=True):
            full = prompt + seq["tokens"]
            want = sequence_logprobs(reference, full[:-1], full[1:])[len(prompt) - 1 :]
            torch.testing.assert_close(torch.tensor(seq["logprobs"]), want, atol=1e-3, rtol=0)
