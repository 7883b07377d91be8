"""One rank of a distributed test, started by `launch.run_ranks`:

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 \
        python -m tests.distributed.spmd_case train --model-dir D --storage S --out R.json

Rank 0 drives the case through the rank-0 proxies and writes its result as JSON; the other
ranks serve commands in `run_worker` until rank 0 shuts them down.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

from tests.distributed.attention_spy import spy
from tests.distributed.launch import leave
from tests.distributed.scenario import (
    OPTIONS,
    drive,
    entry,
    resource_spec,
    resume_and_save,
    session_spec,
    train_packed,
)
from tests.engine.helpers import random_batch
from trainer.checkpoint.store import CheckpointStore
from trainer.contract.embeddings import EmbeddingObjective
from trainer.contract.errors import OperationError
from trainer.contract.specs import LossConfig, Sample
from trainer.distributed.comm import init_distributed
from trainer.distributed.spmd import DistributedResource, Spmd, run_worker


def case_train(spmd: Spmd, store: CheckpointStore, args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for kind in ("full", "lora"):
        resource = DistributedResource(spmd, entry(args.model_dir), resource_spec(kind), store)
        result[kind] = drive(resource, kind)
        reference = json.loads(Path(args.reference).read_text())[kind]["training"]
        result[kind]["resumed"] = resume_and_save(resource, kind, reference)
        result[kind]["invalid"] = _refused(resource, kind)
        resource.close()
    return result


def _refused(resource: DistributedResource, kind: str) -> dict[str, Any]:
    """Bad input fails on every rank alike: a clean error, and the group stays usable."""
    session = resource.create_session(f"{kind}-bad", session_spec(kind))
    bad = random_batch(7, n=3, weights="ones")
    bad[2].model_input.chunks[0].encoded_text.tokens[1] = 10_000  # type: ignore[union-attr]
    try:
        session.forward_backward(LossConfig(type="LOSS_TYPE_CROSS_ENTROPY"), bad)
        refused: dict[str, Any] = {"code": None}
    except OperationError as exc:
        refused = {"code": exc.code, "message": exc.message}
    try:  # an embedding call's bad input too (docs/semantics.md §27)
        texts = [Sample(model_input=s.model_input) for s in bad]
        session.embedding_forward_backward(texts, EmbeddingObjective(output="embedding"), True)
        refused["embedding"] = None
    except OperationError as exc:
        refused["embedding"] = exc.message
    refused["then"] = session.forward_backward(
        LossConfig(type="LOSS_TYPE_CROSS_ENTROPY"), bad[:2], forward_only=True
    )["loss"]
    resource.close_session(f"{kind}-bad")
    return refused


def case_fault(spmd: Spmd, store: CheckpointStore, args: argparse.Namespace) -> dict[str, Any]:
    """TRAINER_DIST_FAULT makes a rank die or raise inside forward_backward: two calls."""
    resource = DistributedResource(spmd, entry(args.model_dir), resource_spec("lora"), store)
    session = resource.create_session("s", session_spec("lora"))
    errors = []
    for _ in range(2):
        start = time.monotonic()
        try:
            session.forward_backward(
                LossConfig(type="LOSS_TYPE_CROSS_ENTROPY"), random_batch(1, n=3, weights="ones")
            )
            errors.append(None)
        except OperationError as exc:
            errors.append(
                {"code": exc.code, "message": exc.message, "seconds": time.monotonic() - start}
            )
    return {"errors": errors}


def case_attention(spmd: Spmd, store: CheckpointStore, args: argparse.Namespace) -> dict[str, Any]:
    """Packed mixed-length calls on both kinds of session, under `attention_spy` (each rank
    writes what its attention saw to `OUT.rank<r>.json`)."""
    result = {}
    for kind in ("full", "lora"):
        resource = DistributedResource(spmd, entry(args.model_dir), resource_spec(kind), store)
        result[kind] = train_packed(resource, kind)
        resource.close()
    return result


def case_muon(spmd: Spmd, store: CheckpointStore, args: argparse.Namespace) -> dict[str, Any]:
    """Muon sessions, both kinds (`muon_scenario`), against `test_muon_sharded`'s reference."""
    from tests.distributed.muon_scenario import drive_muon, muon_resource_spec

    result = {}
    for kind in ("full", "lora"):
        spec = muon_resource_spec(kind, "MUON_SCALING_STRATEGY_ORIGINAL")
        resource = DistributedResource(spmd, entry(args.model_dir), spec, store)
        result[kind] = drive_muon(resource, kind)
        resource.close()
    return result


def case_embed(spmd: Spmd, store: CheckpointStore, args: argparse.Namespace) -> dict[str, Any]:
    """Embedding calls, both kinds (`embed_scenario`), against `test_embed_sharded`'s
    reference."""
    from tests.distributed.embed_scenario import drive_embed

    result = {}
    for kind in ("full", "lora"):
        resource = DistributedResource(spmd, entry(args.model_dir), resource_spec(kind), store)
        result[kind] = drive_embed(resource, kind, args.width)
        resource.close()
    return result


def case_families(spmd: Spmd, store: CheckpointStore, args: argparse.Namespace) -> dict[str, Any]:
    """Each family checkpoint under `--model-dir` (one folder each), sharded: a LoRA session's
    multi-sample forward and its samples (`test_families_sharded` compares them with a plain
    per-sequence forward)."""
    from tests.distributed.scenario import family_forward

    result = {}
    for model_dir in sorted(Path(args.model_dir).iterdir()):
        resource = DistributedResource(spmd, entry(str(model_dir)), resource_spec("lora"), store)
        result[model_dir.name] = family_forward(resource)
        resource.close()
    return result


def case_merged_resume(
    spmd: Spmd, store: CheckpointStore, args: argparse.Namespace
) -> dict[str, Any]:
    """Full weights from LoRA sampler checkpoints (`--reference`: `{"plain": id, "head": id}`,
    the second's adapter training the head of a tied model), sharded: the plain one serves its
    merged files (forward logprobs, `test_merged_resume_sharded` compares them), the other is
    refused on every rank alike, and the group goes on."""
    ids = json.loads(args.reference)
    resource = DistributedResource(spmd, entry(args.model_dir), resource_spec("full"), store)
    result: dict[str, Any] = {}
    try:
        resource.create_session("head", session_spec("full", ids["head"]))
        result["refused"] = None
    except OperationError as exc:
        result["refused"] = {"code": exc.code, "message": exc.message}
    session = resource.create_session("plain", session_spec("full", ids["plain"]))
    samples = random_batch(11, n=3, weights="ones")
    out = session.forward_backward(
        LossConfig(type="cross_entropy"), samples, forward_only=True, return_loss_fn_outputs=True
    )
    result["logprobs"] = [list(o["tensors"]["logprobs"]["data"]) for o in out["loss_fn_outputs"]]
    resource.close()
    return result


def case_grammar(spmd: Spmd, store: CheckpointStore, args: argparse.Namespace) -> dict[str, Any]:
    """Constrained samples, sharded, full weights and LoRA (`test_grammar_sharded` compares
    them with one process's)."""
    from tests.distributed.scenario import grammar_samples
    from tests.distributed.test_grammar_sharded import GRAMMARS

    result = {}
    for kind in ("full", "lora"):
        resource = DistributedResource(spmd, entry(args.model_dir), resource_spec(kind), store)
        result[kind] = grammar_samples(resource, kind, GRAMMARS)
        resource.close()
    return result


CASES = {
    "families": case_families,
    "train": case_train,
    "fault": case_fault,
    "attention": case_attention,
    "muon": case_muon,
    "embed": case_embed,
    "merged_resume": case_merged_resume,
    "grammar": case_grammar,
}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("case", choices=sorted(CASES))
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--storage", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--reference")
    parser.add_argument("--width", type=int, default=0)  # `embed`: the hidden size
    args = parser.parse_args()
    with spy() if args.case == "attention" else contextlib.nullcontext() as seen:
        code = _run(args)
    if seen is not None:
        Path(f"{args.out}.rank{os.environ['RANK']}.json").write_text(json.dumps(seen))
    return code


def _run(args: argparse.Namespace) -> int:
    comm = init_distributed()
    spmd = Spmd(comm, options=OPTIONS)
    if comm.rank != 0:
        return run_worker(spmd)
    store = CheckpointStore(Path(args.storage))
    result = CASES[args.case](spmd, store, args)
    Path(args.out).write_text(json.dumps(result))
    spmd.shutdown()
    return 0


if __name__ == "__main__":
    leave(main())
