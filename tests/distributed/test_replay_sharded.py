"""Routing replay under two CPU ranks (gloo; FSDP2 for full weights, LoRA on a sharded base)
equals one process: keys issued by rank 0 are read by every rank from the shared storage, and
each rank's share of the samples replays its own sequences' routes (docs/semantics.md §12)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.launch import run_ranks
from tests.distributed.replay_case import drive_replay
from tests.distributed.scenario import OPTIONS, entry, resource_spec
from trainer.checkpoint.store import CheckpointStore
from trainer.engine.resource import ModelResource

pytestmark = pytest.mark.distributed

KINDS = ("full", "lora")


@pytest.fixture(scope="module")
def replay_runs(tiny_moe_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("replay-dist")
    storage = work / "storage"
    store = CheckpointStore(storage)
    one = {}
    for kind in KINDS:
        resource = ModelResource(
            entry(str(tiny_moe_dir)), resource_spec(kind), store, device="cpu", options=OPTIONS
        )
        one[kind] = drive_replay(resource, kind)
        resource.close()
    store.close()
    ranks = run_ranks(
        [
            "--model-dir",
            str(tiny_moe_dir),
            "--storage",
            str(storage),
            "--out",
            str(work / "two.json"),
        ],
        world_size=2,
        log_dir=work,
        timeout_s=300.0,
        env={"TRAINER_DIST_TIMEOUT_S": "60"},
        module="tests.distributed.replay_case",
    )
    for rank in ranks:
        assert rank.returncode == 0, f"rank {rank.rank} exited {rank.returncode}:\n{rank.log}"
    return one, json.loads((work / "two.json").read_text())


def _close(a: list[float], b: list[float], tol: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("kind", KINDS)
def test_replay_two_ranks_equal_one_process(replay_runs, kind: str) -> None:
    one, two = replay_runs
    for run in (one[kind], two[kind]):
        assert run["keys"]
        for seq, lps in zip(run["sampled"], run["replayed"], strict=True):
            assert _close(lps[seq["n_prompt"] - 1 :], seq["logprobs"], 1e-5)  # the sampler's
        assert any(not _close(a, f, 1e-4) for a, f in zip(run["after"], run["free"]))
    for a, b in zip(one[kind]["sampled"], two[kind]["sampled"], strict=True):
        assert _close(a["logprobs"], b["logprobs"], 1e-5)
    for name in ("replayed", "after", "free"):
        for a, b in zip(one[kind][name], two[kind][name], strict=True):
            assert _close(a, b, 1e-4), name
    assert one[kind]["loss"] == pytest.approx(two[kind]["loss"], rel=1e-5)
