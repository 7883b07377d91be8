"""One rank of `test_master_weights_sharded`: bf16 weights sharded by FSDP2 over the ranks,
stepped by the session's AdamW, then by its Muon (fp32 masters on both), the full weights and
masters written by rank 0.

    python -m tests.distributed.master_case OUT_FILE   (under tests.distributed.launch)
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from tests.distributed.launch import leave
from trainer.compute import optim
from trainer.compute.muon import MuonWithAdamW
from trainer.contract.muon_params import MuonParams
from trainer.contract.specs import AdamParams

STEPS = 4
CALLS = 3  # gradients accumulated (in fp32) before each step, as forward-backward calls give
ADAM = AdamParams(learning_rate=1e-5, weight_decay=0.01)
MUON = MuonParams(learning_rate=1e-4, weight_decay=0.01, adam=ADAM)
MATCH = "MUON_SCALING_STRATEGY_MATCH_ADAM"
SHAPES = [(6, 8), (6,), (4, 6)]


Grads = list[list[list[torch.Tensor]]]  # [step][call][tensor]


def weights_and_grads() -> tuple[list[torch.Tensor], Grads]:
    """The starting bf16 weights and every step's calls' bf16 gradients (alike on every
    rank)."""
    gen = torch.Generator().manual_seed(3)
    weights = [(torch.randn(s, generator=gen) * 0.05).to(torch.bfloat16) for s in SHAPES]
    grads = [
        [[torch.randn(s, generator=gen).to(torch.bfloat16) for s in SHAPES] for _ in range(CALLS)]
        for _ in range(STEPS)
    ]
    return weights, grads


def new_optimizer(kind: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The session's AdamW, or its Muon (the matrices) with AdamW (the rest), knobs set."""
    if kind == "adamw":
        adamw = optim.new_adamw(params)
        optim.set_adam_knobs(adamw, ADAM)
        return adamw
    matrices = [p for p in params if p.ndim == 2]
    muon = MuonWithAdamW(matrices, [p for p in params if p.ndim != 2], MATCH)
    muon.set_knobs(MUON)
    return muon


def main() -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    weights, grads = weights_and_grads()
    out = {}
    for kind in ("adamw", "muon"):
        model = torch.nn.ParameterList([torch.nn.Parameter(w.clone()) for w in weights])
        fully_shard(model, mesh=mesh)
        params = list(model.parameters())
        opt = new_optimizer(kind, params)
        for step in grads:
            for call in step:
                for param, grad in zip(params, call, strict=True):
                    param.grad = distribute_tensor(grad, mesh, param.placements)
                optim.accumulate_(opt, params)
            opt.step()
            opt.zero_grad()
        for i, param in enumerate(params):
            out[f"{kind}.w{i}"] = param.full_tensor()
            out[f"{kind}.m{i}"] = opt.state[param][optim.MASTER].full_tensor()
            assert param.to_local().numel() < param.numel() or param.numel() < 2  # sharded
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in out.items()}, sys.argv[1])
    dist.barrier()
    return 0


if __name__ == "__main__":
    leave(main())
