"""Routing replay (docs/semantics.md §12) on a tiny Qwen3-MoE, the same calls in one process and
under
two ranks (FSDP2 for full weights): `drive_replay` is both sides of `test_replay_sharded`.

    python -m tests.distributed.replay_case --model-dir D --storage S --out R.json   # one rank
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tests.distributed.launch import leave
from tests.distributed.scenario import OPTIONS, entry, resource_spec, session_spec
from tests.engine.helpers import model_input, sample
from trainer.checkpoint.store import CheckpointStore
from trainer.contract.specs import AdamParams, LossConfig, SamplingParams
from trainer.distributed.comm import init_distributed
from trainer.distributed.spmd import DistributedResource, Spmd, run_worker

CE = LossConfig(type="LOSS_TYPE_CROSS_ENTROPY")
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]


def _logprobs(session: Any, samples: list[Any]) -> list[list[float]]:
    out = session.forward_backward(CE, samples, forward_only=True, return_loss_fn_outputs=True)
    return [list(o["tensors"]["logprobs"]["data"]) for o in out["loss_fn_outputs"]]


def drive_replay(resource: Any, kind: str) -> dict[str, Any]:
    """Sample with keys; replayed forward at the sampling weights; a large step that moves
    routes; replayed and free forwards after it; a keyed forward-backward's loss."""
    session = resource.create_session(f"{kind}-replay", session_spec(kind))
    params = SamplingParams(max_tokens=6, seed=5, temperature=1.0)
    result = session.sample(
        [model_input(p) for p in PROMPTS],
        num_samples=2,
        sampling_params=params,
        return_routed_experts=True,
    )
    keyed, plain, sampled = [], [], []
    for prompt, group in zip(PROMPTS, result["results"], strict=True):
        for seq in group["sequences"]:
            tokens = prompt + seq["tokens"]
            for out, key in ((keyed, seq.get("routed_experts_key")), (plain, None)):
                s = sample(tokens[:-1], tokens[1:], weights=[1.0] * (len(tokens) - 1))
                s.routed_experts_key = key
                out.append(s)
            sampled.append({"n_prompt": len(prompt), "logprobs": seq["logprobs"]})
    out: dict[str, Any] = {
        "keys": all(s.routed_experts_key for s in keyed),
        "sampled": sampled,
        "replayed": _logprobs(session, keyed),
    }
    for _ in range(2):
        session.forward_backward(CE, plain)
        session.optim_step(AdamParams(learning_rate=0.05, grad_clip_norm=0.0))
    out["after"] = _logprobs(session, keyed)
    out["free"] = _logprobs(session, plain)
    out["loss"] = session.forward_backward(CE, keyed)["loss"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--storage", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    comm = init_distributed()
    spmd = Spmd(comm, options=OPTIONS)
    if comm.rank != 0:
        return run_worker(spmd)
    store = CheckpointStore(Path(args.storage))
    result = {}
    for kind in ("full", "lora"):
        resource = DistributedResource(spmd, entry(args.model_dir), resource_spec(kind), store)
        result[kind] = drive_replay(resource, kind)
        resource.close()
    Path(args.out).write_text(json.dumps(result))
    spmd.shutdown()
    return 0


if __name__ == "__main__":
    leave(main())
