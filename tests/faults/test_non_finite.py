"""Non-finite values through the API: JSON cannot carry NaN/Inf (the worker refuses them with a
400), but finite inputs can still overflow float32. Each such operation FAILs with
NON_FINITE_LOSS, and the session is exactly as before: the weights and the optimizer state are
bit-identical (sha256 of a training checkpoint's tensors), the step is unchanged, and the
gradient accumulated before the failures is kept (an optim-step afterwards matches a twin
session that never saw them)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.conftest import serve_in_thread
from tests.faults.procs import (
    CE,
    FAILED,
    ce_sample,
    forward_logprobs,
    model_input,
    new_resource,
    new_session,
    output,
    run_op,
)

SEQ = [5, 9, 33, 70, 2, 101, 64, 7]
N = len(SEQ) - 1
PROBE = [SEQ, [11, 3, 3, 90, 45]]


def _policy_sample(logprobs: float) -> dict[str, Any]:
    inputs = {
        "target_tokens": {"data": SEQ[1:], "dtype": "int64"},
        "logprobs": {"data": [logprobs] * N, "dtype": "float32"},
        "advantages": {"data": [1.0] * N, "dtype": "float32"},
    }
    return {"model_input": model_input(SEQ[:-1]), "loss_fn_inputs": inputs}


OVERFLOWS: list[tuple[str, str, dict[str, Any]]] = [
    # (what overflows, kind, body)
    ("loss", "forward-backward", {"loss": CE, "samples": [ce_sample(SEQ, [3e38] * N)]}),
    ("gradient", "forward-backward", {"loss": CE, "samples": [ce_sample(SEQ, [1e30] * N)]}),
    (
        "gradient",
        "custom-forward-backward",
        {"samples": [ce_sample(SEQ)], "gradients": [{"data": [1e30] * N}]},
    ),
    (
        "loss",
        "custom-forward-backward",
        {"samples": [ce_sample(SEQ)], "gradients": [{"data": [3e38] * N}]},
    ),
    (
        "importance ratio",
        "forward-backward",
        {"loss": {"type": "LOSS_TYPE_IMPORTANCE_SAMPLING"}, "samples": [_policy_sample(-100.0)]},
    ),
    # an update that overflows every weight: the step is undone
    ("update", "optim-step", {"adam_params": {"learning_rate": 100.0, "weight_decay": 1e300}}),
]


def _state_hashes(http: httpx.Client, sid: str, storage: Path) -> dict[str, str]:
    ckpt = output(http, sid, "training-checkpoint")["checkpoint"]["id"]
    root = storage / "checkpoints" / ckpt
    return {
        name: hashlib.sha256((root / name).read_bytes()).hexdigest()
        for name in ("weights.safetensors", "optimizer.safetensors")
    }


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_non_finite_fails_and_changes_nothing(
    tiny_qwen_dir: Path, tmp_path: Path, lora: bool
) -> None:
    storage = tmp_path / "storage"
    with serve_in_thread(storage, {"tiny-qwen": tiny_qwen_dir}) as live, live.client() as http:
        rid = new_resource(http, "tiny-qwen", lora_enabled=lora)
        extra = {"lora_config": {"rank": 4, "seed": 3}} if lora else {}
        sid = new_session(http, rid, **extra)
        good = {"loss": CE, "samples": [ce_sample(SEQ), ce_sample(PROBE[1])]}
        output(http, sid, "forward-backward", good)
        output(http, sid, "optim-step", {"adam_params": {"learning_rate": 1e-2}})
        output(http, sid, "forward-backward", good)  # an accumulated gradient to keep
        before = _state_hashes(http, sid, storage)
        logprobs = forward_logprobs(http, sid, PROBE)

        for what, kind, body in OVERFLOWS:
            op = run_op(http, sid, kind, body)
            assert op["status"] == FAILED, (what, op)
            assert op["error"]["code"] == "TRAINING_OPERATION_ERROR_CODE_NON_FINITE_LOSS", op
            assert "not finite" in op["error"]["message"]

        assert _state_hashes(http, sid, storage) == before, "weights and optimizer unchanged"
        assert forward_logprobs(http, sid, PROBE) == logprobs
        session = http.get(f"/rl/training-sessions/{sid}").json()
        assert session["step"] == 1 and session["status"] == "TRAINING_SESSION_STATUS_RUNNING"
        after_failures = output(http, sid, "optim-step", {"adam_params": {"learning_rate": 1e-2}})

        if lora:  # a twin that never saw the failures: the same update, bit for bit
            twin = new_session(http, rid, **extra)
            output(http, twin, "forward-backward", good)
            output(http, twin, "optim-step", {"adam_params": {"learning_rate": 1e-2}})
            output(http, twin, "forward-backward", good)
            clean = output(http, twin, "optim-step", {"adam_params": {"learning_rate": 1e-2}})
            assert after_failures["metrics"] == clean["metrics"]
            assert forward_logprobs(http, twin, PROBE) == forward_logprobs(http, sid, PROBE)
