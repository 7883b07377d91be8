"""fp32 masters of bf16 weights sharded by FSDP2 (two gloo ranks) step exactly as in one
process: each rank's shard of the weights and masters, gathered, equals `MasterAdamW` (and
Muon with its AdamW) on the whole tensors, each step's calls' gradients summed in fp32. AdamW
is elementwise, and Muon orthogonalises the gathered matrix on every rank alike, so the split
changes no bit."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed.launch import run_ranks
from tests.distributed.master_case import new_optimizer, weights_and_grads
from trainer.compute import optim

pytestmark = pytest.mark.distributed


def test_sharded_bf16_weights_step_like_one_process(tmp_path) -> None:
    out = tmp_path / "sharded.safetensors"
    ranks = run_ranks(
        [str(out)],
        world_size=2,
        log_dir=tmp_path,
        timeout_s=120,
        module="tests.distributed.master_case",
    )
    assert all(r.returncode == 0 for r in ranks), [r.log[-2000:] for r in ranks]
    got = load_file(str(out))

    weights, grads = weights_and_grads()
    moved = 0
    for kind in ("adamw", "muon"):
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        opt = new_optimizer(kind, params)
        for step in grads:
            for call in step:
                for param, grad in zip(params, call, strict=True):
                    param.grad = grad.clone()
                optim.accumulate_(opt, params)
            opt.step()
            opt.zero_grad()
        for i, param in enumerate(params):
            w, m = got[f"{kind}.w{i}"], got[f"{kind}.m{i}"]
            assert w.dtype == torch.bfloat16 and m.dtype == torch.float32
            assert torch.equal(w, param.detach()), (kind, i)
            assert torch.equal(m, opt.state[param][optim.MASTER]), (kind, i)
            moved += int((param.detach() != weights[i]).sum())
    assert moved > 0
