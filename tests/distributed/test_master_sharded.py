"""fp32 masters of bf16 weights sharded by FSDP2 (two gloo ranks) step exactly as in one
process: each rank's shard of the weights and masters, gathered, equals `MasterAdamW` on the
whole tensors (AdamW is elementwise, so the split changes no bit)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed.launch import run_ranks
from tests.distributed.master_case import ADAM, weights_and_grads
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
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = optim.new_adamw(params)
    for step in grads:
        for param, grad in zip(params, step, strict=True):
            param.grad = grad.clone()
        optim.set_adam_knobs(opt, ADAM)
        opt.step()
    moved = 0
    for i, param in enumerate(params):
        assert got[f"w{i}"].dtype == torch.bfloat16 and got[f"m{i}"].dtype == torch.float32
        assert torch.equal(got[f"w{i}"], param.detach()), i
        assert torch.equal(got[f"m{i}"], opt.state[param][optim.MASTER]), i
        moved += int((param.detach() != weights[i]).sum())
    assert moved > 0
