"""One rank of `test_config_torchrun`: `trainer serve`'s flags, parsed as the command does,
join the job (`trainer.cli.join_job`) and drive a LoRA session's forward and forward-backward.
Rank 0 writes what its engine did (counted with forward hooks on its sharded model) as JSON.

    python -m tests.distributed.config_case MODEL_DIR STORAGE OUT [serve flags...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from tests.distributed.launch import leave
from tests.distributed.scenario import resource_spec, session_spec
from trainer.checkpoint.store import CheckpointStore
from trainer.cli import build_parser, join_job, serve_config
from trainer.contract.specs import LossConfig, Sample
from trainer.distributed.spmd import resource_loader, run_worker

SEQUENCES = [[3 + i, 17, 42 + i, 9, 88, 5, 61 + i, 20, 11, 30 + i] for i in range(4)]  # 9 tokens


def _sample(sequence: list[int]) -> Sample:
    n = len(sequence) - 1
    return Sample.model_validate(
        {
            "model_input": {"chunks": [{"encoded_text": {"tokens": sequence[:-1]}}]},
            "loss_fn_inputs": {
                "target_tokens": {"data": sequence[1:], "dtype": "int64"},
                "weights": {"data": [1.0] * n, "dtype": "float32"},
            },
        }
    )


def _offload_policy(model: Any) -> str:
    state = model.get_decoder().layers[0]._get_fsdp_state()
    return type(state._fsdp_param_group.offload_policy).__name__


def main(argv: list[str]) -> int:
    model_dir, storage, out, *flags = argv
    serve = ["serve", "--storage", storage, "--model", f"tiny={model_dir}", "--device", "cpu"]
    config = serve_config(build_parser().parse_args([*serve, *flags]))
    spmd = join_job(config)
    if spmd.comm.rank != 0:
        return run_worker(spmd)
    cpu = torch.device("cpu")
    result: dict[str, Any] = {
        "timeouts": [
            group._get_backend(cpu).options._timeout.total_seconds()
            for group in (spmd.comm.control, spmd.comm.outcomes)
        ],
        "cpu_offload": spmd.executor.cpu_offload,
    }
    if config.distributed.cpu_offload and not torch.cuda.is_available():
        # FSDP2's CPU offload needs an accelerator (pinned memory): nothing to load here
        return _finish(spmd, out, result)
    store = CheckpointStore(Path(storage))
    resource = resource_loader(spmd)(config.models[0], resource_spec("lora"), store, None)
    session = resource.create_session("s", session_spec("lora"))
    model = resource.local.model
    calls = {"layer": 0, "head": 0}

    def counter(name: str) -> Any:
        def hook(*_: Any) -> None:
            calls[name] += 1

        return hook

    model.get_decoder().layers[0].self_attn.register_forward_hook(counter("layer"))
    model.get_output_embeddings().register_forward_hook(counter("head"))
    samples = [_sample(s) for s in SEQUENCES]
    ce = LossConfig(type="LOSS_TYPE_CROSS_ENTROPY")
    session.forward_backward(ce, samples, forward_only=True)
    result["forward"], calls["layer"], calls["head"] = dict(calls), 0, 0
    session.forward_backward(ce, samples)
    result["backward"] = dict(calls)
    result["offload"] = _offload_policy(model)
    result["checkpointing"] = bool(model.is_gradient_checkpointing)
    resource.close()
    return _finish(spmd, out, result)


def _finish(spmd: Any, out: str, result: dict[str, Any]) -> int:
    Path(out).write_text(json.dumps(result))
    spmd.shutdown()
    return 0


if __name__ == "__main__":
    leave(main(sys.argv[1:]))
