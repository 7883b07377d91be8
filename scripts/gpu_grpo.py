"""A GRPO loop through `trainer serve` and the `together` SDK, with the sampler-vs-trainer gap.

    python scripts/gpu_grpo.py --device cuda --dtype bfloat16 --shape qwen3-0.6b --json out.json
    python scripts/gpu_grpo.py --device cpu --dtype float32 --shape tiny      # the rehearsal

Builds a Qwen3-shaped model with random weights (no download), starts a worker on it
(`python -m trainer serve`, its own process, as a user runs it), and drives it with the SDK's own
calls: a LoRA session; each step samples a group of completions of one prompt from the session's
published weights (the in-process generator), scores the same tokens with the trainer's
`forward`, trains one `LOSS_TYPE_IMPORTANCE_SAMPLING` step on group-centred advantages, and
publishes the new weights. The gap is |sampler logprob - trainer logprob| over every completion
token: 0 up to rounding in float32; in bf16 it is the number docs/semantics.md's bf16 note
talks about. Prints one JSON object (and writes it with `--json`): per step the seconds, the
mean reward, the gap's max and mean, and the loss's importance-ratio mean.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import torch  # noqa: E402

from benchmarks.shapes import ModelShape  # noqa: E402
from trainer import tiny  # noqa: E402

SHAPES = {
    "qwen3-0.6b": ModelShape(
        hidden=1024, intermediate=3072, layers=28, heads=16, kv_heads=8, head_dim=128
    ),
    "tiny": ModelShape(vocab=2048, hidden=64, intermediate=128, layers=2, heads=4, head_dim=16),
}
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]
IS_LOSS = {"type": "LOSS_TYPE_IMPORTANCE_SAMPLING"}


def build_model(shape: ModelShape, out_dir: Path, dtype: torch.dtype, device: str) -> Path:
    """Random weights of `shape` (seed 0), built on `device` and saved in `dtype`."""
    torch.manual_seed(0)
    with torch.device(device):
        model = tiny.build_model(shape, seed=0, dtype=dtype)
    model.save_pretrained(out_dir)
    del model
    return out_dir


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_worker(model_dir: Path, storage: Path, device: str, dtype: str, token: str) -> Any:
    port = free_port()
    env = {**os.environ, "TRAINER_API_TOKEN": token, "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    command = [
        sys.executable,
        "-m",
        "trainer",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--storage",
        str(storage),
        "--device",
        device,
        "--model",
        f"grpo={model_dir},dtype={dtype},max_lora_rank=64,max_seq_length=4096",
        "--log-level",
        "warning",
    ]
    process = subprocess.Popen(command, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"gpu_grpo: the worker exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return process, f"{url}/v1"
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise SystemExit("gpu_grpo: the worker did not answer /healthz within 300 s")


def tensor(data: list[Any], dtype: str = "float32") -> dict[str, Any]:
    return {"data": data, "dtype": dtype}


def model_input(tokens: list[int]) -> dict[str, Any]:
    return {"chunks": [{"encoded_text": {"tokens": tokens}}]}


def training_sample(
    tokens: list[int], sampled: list[float], advantage: float | None
) -> dict[str, Any]:
    """The prompt + completion as one datum; loss only on the completion's tokens."""
    sequence = PROMPT + tokens
    n, p = len(sequence) - 1, len(PROMPT) - 1
    mask = [0.0] * p + [1.0] * len(tokens)
    inputs: dict[str, Any] = {"target_tokens": tensor(sequence[1:], "int64")}
    if advantage is None:
        inputs["weights"] = tensor(mask)
    else:
        inputs["logprobs"] = tensor([0.0] * p + sampled)
        inputs["advantages"] = tensor([advantage * m for m in mask])
        inputs["mask"] = tensor(mask)
    assert len(mask) == n
    return {"model_input": model_input(sequence[:-1]), "loss_fn_inputs": inputs}


def reward(tokens: list[int], vocab: int) -> float:
    """The share of completion tokens in the lower half of the vocabulary."""
    return sum(t < vocab // 2 for t in tokens) / max(1, len(tokens))


def run(args: argparse.Namespace, api: str, token: str, vocab: int) -> dict[str, Any]:
    from together.post_training import ModelResourcesClient

    steps: list[dict[str, Any]] = []
    with ModelResourcesClient.create(
        api_key=token, base_url=api, base_model="grpo", interval=0.2
    ) as resource:
        session = resource.create_session(
            lora_config={"rank": args.rank, "alpha": 2 * args.rank, "seed": 0}, interval=0.2
        )
        trainer = session.trainer
        trainer.weights_sync()
        for step in range(args.steps):
            start = time.perf_counter()
            result = session.generator.sample(
                model_input(PROMPT),
                num_samples=args.group,
                sampling_params={
                    "max_tokens": args.tokens,
                    "temperature": 1.0,
                    "seed": 1000 + step,
                },
            )
            sampled_s = time.perf_counter() - start
            group = [([int(t) for t in s.tokens], list(s.logprobs)) for s in result.sequences]
            scored = trainer.forward(
                samples=[training_sample(t, lp, None) for t, lp in group],
                loss={"type": "LOSS_TYPE_CROSS_ENTROPY"},
            )
            gaps: list[float] = []
            for (_, sampled), out in zip(group, scored.loss_fn_outputs, strict=True):
                trained = list(out.tensors["logprobs"].data)[len(PROMPT) - 1 :]
                gaps += [abs(a - b) for a, b in zip(sampled, trained, strict=True)]
            rewards = [reward(t, vocab) for t, _ in group]
            mean = statistics.fmean(rewards)
            samples = [
                training_sample(t, lp, r - mean) for (t, lp), r in zip(group, rewards, strict=True)
            ]
            trained_out = trainer.forward_backward(samples=samples, loss=IS_LOSS)
            trainer.optim_step(adam_params={"learning_rate": args.lr})
            version = int(trainer.weights_sync().weights_version)
            metrics = dict(trained_out.metrics or {})
            steps.append(
                {
                    "step": step,
                    "version": version,
                    "seconds": time.perf_counter() - start,
                    "sample_seconds": sampled_s,
                    "sample_tokens_per_s": sum(len(t) for t, _ in group) / sampled_s,
                    "reward_mean": mean,
                    "gap_max": max(gaps),
                    "gap_mean": statistics.fmean(gaps),
                    "ratio_mean": metrics.get("loss/ratio/mean"),
                    "loss": trained_out.loss,
                }
            )
            print(json.dumps(steps[-1]), flush=True)
        session.stop()
    return {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "shape": args.shape,
        "dtype": args.dtype,
        "group": args.group,
        "tokens": args.tokens,
        "rank": args.rank,
        "steps": steps,
        "gap_max": max(s["gap_max"] for s in steps),
        "gap_mean": statistics.fmean(s["gap_mean"] for s in steps),
        "step_seconds_median": statistics.median(s["seconds"] for s in steps),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    token = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="gpu-grpo-") as tmp:
        dtype = getattr(torch, args.dtype)
        model_dir = build_model(shape, Path(tmp) / "model", dtype, args.device)
        process, api = start_worker(
            model_dir, Path(tmp) / "storage", args.device, args.dtype, token
        )
        try:
            figures = run(args, api, token, shape.vocab)
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
    print(json.dumps({k: v for k, v in figures.items() if k != "steps"}))
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
