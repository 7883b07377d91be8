"""The sharded path computes attention exactly as one process does: the same attention
function (packed varlen SDPA on CPU), the samples of a micro-batch as one unpadded row with no
mask, and no dense `[rows, 1, L, L]` mask built, with equal losses on packed mixed-length
batches. Two gloo ranks against this process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.distributed.attention_spy import spy
from tests.distributed.launch import two_rank_case
from tests.distributed.scenario import OPTIONS, entry, resource_spec, train_packed
from trainer.checkpoint.store import CheckpointStore
from trainer.engine.resource import ModelResource

pytestmark = pytest.mark.distributed


def _one_process(model_dir: Path, storage: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    store = CheckpointStore(storage)
    result = {}
    with spy() as seen:
        for kind in ("full", "lora"):
            resource = ModelResource(
                entry(str(model_dir)), resource_spec(kind), store, device="cpu", options=OPTIONS
            )
            result[kind] = train_packed(resource, kind)
            resource.close()
    store.close()
    return result, seen


def test_sharded_attention_is_the_packed_path_of_one_process(
    tiny_qwen_dir: Path, tmp_path: Path
) -> None:
    one, one_seen = _one_process(tiny_qwen_dir, tmp_path / "one")
    out = tmp_path / "two.json"
    two = two_rank_case("attention", tiny_qwen_dir, tmp_path / "two", tmp_path)
    # the reference itself is the packed path: one function, no mask, one row per call
    assert one_seen["dense_masks"] == 0
    assert len(one_seen["functions"]) == 1, one_seen["functions"]
    assert one_seen["functions"][0].startswith("packed_sdpa:")
    for r in range(2):
        seen = json.loads(Path(f"{out}.rank{r}.json").read_text())
        assert seen["dense_masks"] == 0, f"rank {r} built a dense [rows, 1, L, L] mask"
        assert seen["functions"] == one_seen["functions"], r
        assert seen["calls"], r
        for call in seen["calls"]:
            assert call == {"rows": 1, "tokens": call["tokens"], "mask": False}, (r, call)
    tokens = [c["tokens"] for c in json.loads(Path(f"{out}.rank0.json").read_text())["calls"]]
    assert max(tokens) > 6  # several samples (each ≤ 6 tokens) share a row
    for kind in ("full", "lora"):
        for name in ("train", "forward"):
            a, b = one[kind][name], two[kind][name]
            assert abs(a - b) <= 1e-4 * max(abs(a), 1e-3), (kind, name, a, b)
