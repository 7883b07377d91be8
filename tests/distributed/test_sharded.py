"""FSDP2 sessions under two CPU ranks (gloo) against one process, checkpoints across world
sizes, and a rank that dies mid-operation.

One 2-rank run (`spmd_case train`) drives a full-weight and a LoRA session through the rank-0
proxies, after the same calls were made in this process (`scenario.drive`); the tests compare
the two. Ranks are plain subprocesses bounded by a timeout, so nothing here can hang.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tests.distributed.launch import run_ranks
from tests.distributed.scenario import OPTIONS, drive, entry, resource_spec, session_spec
from trainer.checkpoint.store import CheckpointStore
from trainer.compute import optim
from trainer.engine.resource import ModelResource

pytestmark = pytest.mark.distributed

KINDS = ("full", "lora")
RUN_TIMEOUT_S = 300.0


@dataclass
class Runs:
    storage: Path
    model_dir: Path
    one: dict[str, Any]  # the 1-process reference, by kind
    two: dict[str, Any]  # the 2-rank run, by kind


@pytest.fixture(scope="module")
def runs(tiny_qwen_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    work = tmp_path_factory.mktemp("dist")
    storage = work / "storage"
    store = CheckpointStore(storage)
    one = {}
    for kind in KINDS:
        resource = _resource(tiny_qwen_dir, kind, store)
        one[kind] = drive(resource, kind)
        resource.close()
    store.close()
    (work / "one.json").write_text(json.dumps(one))
    ranks = run_ranks(
        [
            *("train", "--model-dir", str(tiny_qwen_dir), "--storage", str(storage)),
            *("--out", str(work / "two.json"), "--reference", str(work / "one.json")),
        ],
        world_size=2,
        log_dir=work,
        timeout_s=RUN_TIMEOUT_S,
        env={"TRAINER_DIST_TIMEOUT_S": "60"},
    )
    for rank in ranks:
        assert rank.returncode == 0, f"rank {rank.rank} exited {rank.returncode}:\n{rank.log}"
    two = json.loads((work / "two.json").read_text())
    return Runs(storage, tiny_qwen_dir, one, two)


def _resource(model_dir: Path, kind: str, store: CheckpointStore) -> ModelResource:
    return ModelResource(
        entry(str(model_dir)), resource_spec(kind), store, device="cpu", options=OPTIONS
    )


def _close(a: float, b: float, rel: float = 1e-4) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-3)


def _assemble(directory: Path) -> dict[str, torch.Tensor]:
    """Full tensors from DCP's per-rank safetensors files, read independently of the engine:
    each file's header says where its slices go (`DCP_SHARDING_INFO`)."""
    pieces: dict[str, list[tuple[list[int], torch.Tensor]]] = defaultdict(list)
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as fh:
            info = json.loads((fh.metadata() or {}).get("DCP_SHARDING_INFO", "{}"))
            for key in fh.keys():  # noqa: SIM118 - safe_open is not a dict
                tensor = fh.get_tensor(key)
                offsets = info.get(key, {}).get("saved_offsets") or [0] * tensor.dim()
                pieces[key].append((offsets, tensor))
    full = {}
    for key, parts in pieces.items():
        ndim = parts[0][1].dim()
        shape = [max(o[d] + t.shape[d] for o, t in parts) for d in range(ndim)]
        out = torch.empty(shape, dtype=parts[0][1].dtype)
        for offsets, tensor in parts:
            out[tuple(slice(o, o + n) for o, n in zip(offsets, tensor.shape))] = tensor
        full[key] = out
    return full


def _checkpoint(storage: Path, checkpoint_id: str) -> dict[str, torch.Tensor]:
    """Weights and optimizer state of a training checkpoint, whatever wrote it."""
    path = storage / "checkpoints" / checkpoint_id
    if (path / "weights.safetensors").exists():
        return {
            **load_file(str(path / "weights.safetensors")),
            **load_file(str(path / "optimizer.safetensors")),
        }
    assert not (path / "weights.safetensors").exists()
    return _assemble(path / "sharded")


def states_close(storage: Path, one: str, two: str) -> dict[str, torch.Tensor]:
    """Two training checkpoints' weights and optimizer state agree, tensor by tensor, within
    1e-4 of each tensor's norm; the first's tensors."""
    a, b = _checkpoint(storage, one), _checkpoint(storage, two)
    assert a.keys() == b.keys()
    for key in a:
        error = float((a[key].double() - b[key].double()).norm())
        assert error <= 1e-4 * max(float(a[key].double().norm()), 1e-6), key
    return a


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("kind", KINDS)
def test_losses_and_metrics_equal_one_process(runs: Runs, kind: str) -> None:
    one, two = runs.one[kind], runs.two[kind]
    assert two["step"] == one["step"] == 4
    for a_step, b_step in zip(one["steps"], two["steps"], strict=True):
        for a, b in zip(a_step, b_step, strict=True):  # ppo loss, grpo loss, grad norm
            assert _close(a, b), (one["steps"], two["steps"])
    for name in ("ppo_metrics",):
        assert one[name].keys() == two[name].keys()
        assert all(_close(one[name][k], two[name][k]) for k in one[name]), (one[name], two[name])
    sa, sb = one["soft"], two["soft"]  # [T, 3] soft targets: the loss and [T, 3] outputs
    assert _close(sa["loss"], sb["loss"])
    for oa, ob in zip(sa["loss_fn_outputs"], sb["loss_fn_outputs"], strict=True):
        a, b = oa["tensors"]["logprobs"], ob["tensors"]["logprobs"]
        assert a["shape"] == b["shape"] and a["shape"][1] == 3
        assert torch.allclose(
            torch.tensor(a["data"]), torch.tensor(b["data"]), rtol=1e-4, atol=1e-5
        )
    fa, fb = one["forward"], two["forward"]
    assert _close(fa["loss"], fb["loss"])
    assert all(_close(fa["metrics"][k], fb["metrics"][k]) for k in fa["metrics"])
    for oa, ob in zip(fa["loss_fn_outputs"], fb["loss_fn_outputs"], strict=True):
        a, b = oa["tensors"]["logprobs"]["data"], ob["tensors"]["logprobs"]["data"]
        assert torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_bad_input_fails_on_every_rank_and_the_group_stays_usable(runs: Runs, kind: str) -> None:
    refused = runs.two[kind]["invalid"]
    assert refused["code"] == "INVALID_INPUT"
    assert refused["message"].startswith(
        "samples[2].model_input.chunks[0].encoded_text.tokens[1]: token id 10000"
    )
    assert refused["embedding"].startswith(
        "samples[2].model_input.chunks[0].encoded_text.tokens[1]: token id 10000"
    )
    assert refused["then"] > 0  # the next call on the same group ran


@pytest.mark.parametrize("kind", KINDS)
def test_weights_after_training_equal_one_process(runs: Runs, kind: str) -> None:
    one = _checkpoint(runs.storage, runs.one[kind]["training"])
    two = _checkpoint(runs.storage, runs.two[kind]["training"])
    sharded = not (runs.storage / "checkpoints" / runs.two[kind]["training"] / "sharded").exists()
    assert sharded == (kind == "lora")  # full weights: DCP shards, one file per rank
    assert one.keys() == two.keys()
    for key in one:
        error = float((one[key].double() - two[key].double()).norm())
        assert error <= 1e-4 * max(float(one[key].double().norm()), 1e-6), key


@pytest.mark.parametrize("kind", KINDS)
def test_sampling_returns_the_same_tokens(runs: Runs, kind: str) -> None:
    for name in ("sample0", "sample1"):
        seqs_a = runs.one[kind][name]["results"][0]["sequences"]
        seqs_b = runs.two[kind][name]["results"][0]["sequences"]
        assert [s["tokens"] for s in seqs_a] == [s["tokens"] for s in seqs_b]
        for a, b in zip(seqs_a, seqs_b, strict=True):
            assert torch.allclose(
                torch.tensor(a["logprobs"]), torch.tensor(b["logprobs"]), atol=1e-5
            )


@pytest.mark.parametrize("kind", KINDS)
def test_one_rank_checkpoint_resumes_on_two_ranks_bit_for_bit(runs: Runs, kind: str) -> None:
    saved = _checkpoint(runs.storage, runs.one[kind]["training"])
    resumed = _checkpoint(runs.storage, runs.two[kind]["resumed"]["training"])
    _assert_equal(saved, resumed)
    rng = "checkpoints/{}/rng.safetensors"
    _assert_equal(
        load_file(str(runs.storage / rng.format(runs.one[kind]["training"]))),
        load_file(str(runs.storage / rng.format(runs.two[kind]["resumed"]["training"]))),
    )


@pytest.mark.parametrize("kind", KINDS)
def test_two_rank_checkpoint_resumes_on_one_rank_bit_for_bit(runs: Runs, kind: str) -> None:
    checkpoint_id = runs.two[kind]["training"]
    saved = _checkpoint(runs.storage, checkpoint_id)
    store = CheckpointStore(runs.storage)
    resource = _resource(runs.model_dir, kind, store)
    try:
        session = resource.create_session("resumed", session_spec(kind, checkpoint_id))
        assert session.step == runs.two[kind]["step"]
        state = {n: p.detach().clone() for n, p in session.policy.trainable.items()}
        state.update(optim.state_tensors(session.optimizer, session.policy.trainable))
        _assert_equal(saved, state)
    finally:
        resource.close()
        store.close()


@pytest.mark.parametrize("kind", KINDS)
def test_inference_checkpoint_is_identical_whatever_the_world_size(runs: Runs, kind: str) -> None:
    """The 2-rank run exported the state it resumed from the 1-process checkpoint."""
    one = Path(runs.one[kind]["inference"])
    two = Path(runs.two[kind]["resumed"]["inference"])
    names = sorted(
        p.relative_to(one).as_posix()
        for p in one.rglob("*")
        if p.is_file() and p.parts[-2] in ("merged", "adapter")
    )
    assert "merged/model.safetensors" in names
    assert ("adapter/adapter_model.safetensors" in names) == (kind == "lora")
    for name in names:
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
    if kind == "lora":  # the adapter exports too, the export's arguments sent to every rank
        one, two = Path(runs.one[kind]["export"]), Path(runs.two[kind]["resumed"]["export"])
        for name in ("adapter/adapter_config.json", "adapter/adapter_model.safetensors"):
            assert (one / name).read_bytes() == (two / name).read_bytes(), name
        sealed = Path(runs.two[kind]["resumed"]["sealed"]) / "adapter"
        assert sorted(p.name for p in sealed.iterdir()) == [
            "adapter_config.json.age",
            "adapter_model.safetensors.age",
        ]


@pytest.mark.parametrize(
    ("fault", "code_1", "says"),
    [
        ("1:micro_batch", 17, "a peer rank is dead or stuck"),  # rank 1 dies (os._exit)
        ("1:micro_batch:raise", 1, "rank 1: RuntimeError: injected fault at micro_batch"),
    ],
    ids=["dies", "raises"],
)
def test_a_failing_rank_fails_the_operation_everywhere_and_nothing_hangs(
    tiny_qwen_dir: Path, tmp_path: Path, fault: str, code_1: int, says: str
) -> None:
    """Rank 1 dies, or raises alone, inside forward-backward: rank 0's call fails with an
    error naming what happened, the next call fails at once (the group is broken), rank 1
    exits (17: killed; 1: left its loop), and rank 0 exits normally."""
    out = tmp_path / "fault.json"
    ranks = run_ranks(
        [
            *("fault", "--model-dir", str(tiny_qwen_dir)),
            *("--storage", str(tmp_path / "s"), "--out", str(out)),
        ],
        world_size=2,
        log_dir=tmp_path,
        timeout_s=120.0,
        env={"TRAINER_DIST_TIMEOUT_S": "8", "TRAINER_DIST_FAULT": fault},
    )
    assert ranks[1].returncode == code_1, ranks[1].log
    assert ranks[0].returncode == 0, ranks[0].log
    first, second = json.loads(out.read_text())["errors"]
    assert first["code"] == "INTERNAL_ERROR"
    assert "forward_backward failed" in first["message"]
    assert says in first["message"], first["message"]
    assert first["seconds"] < 30
    assert second["code"] == "INTERNAL_ERROR"
    assert "broken" in second["message"]
    assert second["seconds"] < 1


def test_workers_exit_when_rank_zero_dies(tiny_qwen_dir: Path, tmp_path: Path) -> None:
    ranks = run_ranks(
        [
            "fault",
            "--model-dir",
            str(tiny_qwen_dir),
            "--storage",
            str(tmp_path / "s"),
            "--out",
            str(tmp_path / "f.json"),
        ],
        world_size=2,
        log_dir=tmp_path,
        timeout_s=120.0,
        env={"TRAINER_DIST_TIMEOUT_S": "8", "TRAINER_DIST_FAULT": "0:micro_batch"},
    )
    assert ranks[0].returncode == 17, ranks[0].log
    assert ranks[1].returncode == 1, ranks[1].log
