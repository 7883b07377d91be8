"""GPU throughput: a Qwen3-0.6B-shaped random model, LoRA and full weights, 16k packed tokens, bf16.

    python scripts/bench_gpu.py                  # one CUDA GPU, well under 5 minutes
    python scripts/bench_gpu.py --grad-ckpt      # with activation checkpointing
    python scripts/bench_gpu.py --tiny           # CPU smoke check of the same code path
    python scripts/bench_gpu.py --merge-only     # only the merged-vs-serial row

Each mode builds the model from a config (random weights, no download) directly on the device,
packs mixed-length samples (256–2048 tokens) into one 16,384-token micro-batch, and times
forward + chunked logprob head + backward + AdamW steps: the engine's own pieces (`pack`,
`decoder_inputs`, `token_logprobs`), with FlashAttention varlen when `flash_attn` is installed
and `packed_sdpa` otherwise. MFU = model FLOPs / time / the GPU's dense bf16 peak, with model
FLOPs = 6·N·T (full) or 4·N·T + 6·N_lora·T (LoRA) + 6·layers·q_dim·Σ sᵢ² (causal attention).
Prints one table.

Then the merged-vs-serial row: one LoRA resource of the engine (`ModelResource`, the
same model saved and loaded as a worker does) with `--merge-sessions` sessions (default 8),
each sending forward-backward calls of `--merge-samples` x `--merge-tokens` tokens (default
4 x 32, cross entropy). Merged: every session on its own thread, a round's calls sent at once
(`[engine] merge` on, the default window), so the scheduler runs them as one pass. Serial: the
same calls one at a time on a twin resource with merging off. The arms alternate round by
round; medians of the rounds' times. Prints a second table: calls/s of each arm, the ratio, and
the scheduler's counters (calls of the merged arm that missed the window ran alone, and show there).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.shapes import ModelShape, qwen3_config  # noqa: E402
from trainer.compute.attention import PACKED_SDPA, use_packed_sdpa  # noqa: E402
from trainer.compute.batch import PreparedSample, pack  # noqa: E402
from trainer.compute.logprobs import token_logprobs  # noqa: E402
from trainer.tiny import TinySpec  # noqa: E402

QWEN3_06B = ModelShape(
    hidden=1024, intermediate=3072, layers=28, heads=16, kv_heads=8, head_dim=128
)
TINY = ModelShape(vocab=2048, hidden=64, intermediate=128, layers=2, heads=4, head_dim=16)
# Dense bf16 tensor-core peaks (NVIDIA datasheets), matched against the device name in this
# order, so that a PCIe or NVL H100 and a GB200 are not read as the SXM H100 or the B200.
PEAK_BF16_TFLOPS = {
    "H100 PCIe": 756.0,
    "H100 NVL": 835.5,
    "GB200": 2500.0,
    "B200": 2250.0,
    "H200": 989.4,
    "H100": 989.4,
    "H800": 989.4,
    "A100": 312.0,
    "L40S": 362.1,
}


@dataclass
class Result:
    mode: str
    tokens: int
    step_s: float
    flops: float
    peak_mem_gb: float

    def figures(self, peak_flops: float) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "tokens": self.tokens,
            "step_s": self.step_s,
            "tokens_per_s": self.tokens / self.step_s,
            "tflops": self.flops / self.step_s / 1e12,
            "mfu": self.flops / self.step_s / peak_flops,
            "peak_mem_gb": self.peak_mem_gb,
        }

    def row(self, peak_flops: float) -> str:
        tflops = self.flops / self.step_s / 1e12
        mfu = self.flops / self.step_s / peak_flops
        return (
            f"| {self.mode} | {self.tokens:,} | {self.step_s * 1e3:.0f} ms | "
            f"{self.tokens / self.step_s:,.0f} | {tflops:.1f} | {mfu:.1%} | "
            f"{self.peak_mem_gb:.1f} |"
        )


def peak_tflops_of(name: str) -> float | None:
    """The dense bf16 peak of the GPU called `name` (torch's device name), None if unknown."""
    return next((tflops for key, tflops in PEAK_BF16_TFLOPS.items() if key in name), None)


def peak_flops(device: torch.device, override: float | None) -> float:
    if override:
        return override * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        tflops = peak_tflops_of(name)
        if tflops is None:
            raise SystemExit(f"unknown GPU {name!r}: pass --peak-tflops (dense bf16)")
        return tflops * 1e12
    a = torch.randn(1024, 1024, dtype=torch.bfloat16)
    a @ a
    start = time.perf_counter()
    a @ a
    return 2 * 1024**3 / (time.perf_counter() - start)


def lengths_summing_to(total: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while sum(out) < total:
        out.append(int(torch.randint(lo, hi + 1, (), generator=gen)))
    out[-1] -= sum(out) - total
    if out[-1] < 2:
        out[-2] += out.pop()
    return out


def build(shape: ModelShape, device: torch.device, lora_rank: int | None) -> tuple[Any, str]:
    from transformers import AutoModelForCausalLM

    config = qwen3_config(shape, max_position_embeddings=40960)
    attn = "sdpa"
    if device.type == "cuda":
        try:
            import flash_attn  # noqa: F401

            attn = "flash_attention_2"
        except ImportError:
            pass
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.bfloat16, attn_implementation=attn
        )
    if attn == "sdpa":
        use_packed_sdpa(model)
        attn = PACKED_SDPA
    if lora_rank is not None:
        from peft import LoraConfig, get_peft_model

        peft_config = LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, target_modules="all-linear")
        model = get_peft_model(model, peft_config).base_model.model
    model.train()
    return model, attn


def run_mode(
    shape: ModelShape,
    device: torch.device,
    tokens: int,
    lora_rank: int | None,
    steps: int,
    warmup: int,
    grad_ckpt: bool,
    chunk_tokens: int,
) -> Result:
    model, attn = build(shape, device, lora_rank)
    if grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if lora_rank is not None:
            model.enable_input_require_grads()
    lengths = lengths_summing_to(tokens, min(256, tokens // 4), min(2048, tokens // 2))
    gen = torch.Generator().manual_seed(1)
    samples = []
    for i, n in enumerate(lengths):
        seq = torch.randint(0, shape.vocab, (n + 1,), generator=gen)
        samples.append(PreparedSample(i, seq[:-1], seq[1:], torch.ones(n)))
    (micro,) = pack(samples, row_tokens=tokens, token_budget=tokens)
    inputs, keep = micro.decoder_inputs(attn, device)
    targets = micro.targets_P.to(device)
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5, fused=device.type == "cuda")

    def step() -> None:
        hidden = decoder(**inputs, use_cache=False).last_hidden_state
        hidden_P_H = hidden.reshape(-1, hidden.shape[-1])[keep]
        logprobs, _ = token_logprobs(hidden_P_H, head, targets, chunk_tokens=chunk_tokens)
        (-logprobs.mean()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        step()
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    step_s = (time.perf_counter() - start) / steps
    memory = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else 0.0
    counts = shape.params()
    n_matmul = counts["decoder"] + shape.vocab * shape.hidden
    n_lora = sum(p.numel() for p in params) if lora_rank is not None else 0
    dense = (4 * n_matmul + 6 * n_lora) if lora_rank is not None else 6 * n_matmul
    attention = 6 * shape.layers * shape.heads * shape.head_dim * sum(n * n for n in lengths)
    mode = f"LoRA r{lora_rank}" if lora_rank is not None else "full"
    if grad_ckpt:
        mode += " + act. ckpt"
    return Result(mode, tokens, step_s, float(dense * tokens + attention), memory)


@dataclass
class MergeResult:
    sessions: int
    call_tokens: int
    serial_s: float  # median time of a round (one call per session)
    merged_s: float
    counters: dict[str, int]
    calls: int  # calls of the merged arm, warm-up excluded

    def figures(self) -> dict[str, Any]:
        return {
            "sessions": self.sessions,
            "call_tokens": self.call_tokens,
            "serial_calls_per_s": self.sessions / self.serial_s,
            "merged_calls_per_s": self.sessions / self.merged_s,
            "merged_over_serial": self.serial_s / self.merged_s,
            **self.counters,
            "calls": self.calls,
        }

    def row(self) -> str:
        calls = self.sessions
        return (
            f"| {self.sessions} x {self.call_tokens} | {calls / self.serial_s:,.1f} | "
            f"{calls / self.merged_s:,.1f} | {self.serial_s / self.merged_s:.2f}x | "
            f"{self.counters['merged_items']} of {self.calls} calls in "
            f"{self.counters['merged_passes']} merged passes |"
        )


def run_merge(
    shape: TinySpec,
    device: torch.device,
    sessions: int,
    samples: int,
    tokens: int,
    rounds: int,
    lora_rank: int,
    merge_window_ms: float | None = None,
) -> MergeResult:
    """Merged vs serial forward-backward calls of `sessions` LoRA sessions (see the docstring)."""
    import statistics
    import tempfile
    import threading

    from trainer.checkpoint.store import CheckpointStore
    from trainer.contract.options import EngineOptions
    from trainer.contract.specs import (
        LoraConfig,
        LossConfig,
        ModelEntry,
        ResourceSpec,
        Sample,
        SessionSpec,
    )
    from trainer.engine.resource import ModelResource
    from trainer.tiny import save_model

    tmp = Path(tempfile.mkdtemp(prefix="bench_gpu_merge_"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model_dir = save_model(shape, tmp / "model", dtype=dtype)
    entry = ModelEntry(
        name="m",
        location=str(model_dir),
        max_seq_length=max(512, tokens + 1),
        max_lora_rank=max(64, lora_rank),
        dtype="bfloat16" if dtype == torch.bfloat16 else "float32",
    )
    spec = ResourceSpec.model_validate({"base_model": "m", "lora_enabled": True})

    def resource(name: str, options: EngineOptions) -> Any:
        built = ModelResource(
            entry, spec, CheckpointStore(tmp / name), device=str(device), options=options
        )
        for i in range(sessions):
            lora = LoraConfig(rank=lora_rank, alpha=2 * lora_rank, seed=i)
            built.create_session(f"s{i}", SessionSpec(lora_config=lora))
        return built

    gen = torch.Generator().manual_seed(2)
    batches = []
    for _ in range(sessions):
        batch = []
        for _ in range(samples):
            seq = torch.randint(2, shape.vocab, (tokens + 1,), generator=gen).tolist()
            batch.append(
                Sample.model_validate(
                    {
                        "model_input": {"chunks": [{"encoded_text": {"tokens": seq[:-1]}}]},
                        "loss_fn_inputs": {
                            "target_tokens": {"data": seq[1:], "dtype": "int64"},
                            "weights": {"data": [1.0] * tokens, "dtype": "float32"},
                        },
                    }
                )
            )
        batches.append(batch)
    ce = LossConfig(type="LOSS_TYPE_CROSS_ENTROPY")
    merged_options = EngineOptions()
    if merge_window_ms is not None:
        merged_options = EngineOptions(merge_window_ms=merge_window_ms)
    merged = resource("merged", merged_options)
    serial = resource("serial", EngineOptions(merge=False))

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def serial_round() -> float:
        start = time.perf_counter()
        for session, batch in zip(serial.sessions.values(), batches, strict=True):
            session.forward_backward(ce, batch)
        sync()
        return time.perf_counter() - start

    def merged_round() -> float:
        barrier = threading.Barrier(sessions + 1)
        errors: list[BaseException] = []

        def call(session: Any, batch: list[Any]) -> None:
            barrier.wait()
            try:
                session.forward_backward(ce, batch)
            except BaseException as exc:  # re-raised below: a failed arm is no figure
                errors.append(exc)

        threads = [
            threading.Thread(target=call, args=pair)
            for pair in zip(merged.sessions.values(), batches, strict=True)
        ]
        for thread in threads:
            thread.start()
        barrier.wait()
        start = time.perf_counter()
        for thread in threads:
            thread.join()
        sync()
        if errors:
            raise errors[0]
        return time.perf_counter() - start

    merged_round(), serial_round()  # warm-up
    before = dict(merged.scheduler.counters())
    serial_times, merged_times = [], []
    for _ in range(rounds):
        serial_times.append(serial_round())
        merged_times.append(merged_round())
    after = merged.scheduler.counters()
    counters = {k: after[k] - before[k] for k in ("passes", "merged_passes", "merged_items")}
    merged.close()
    serial.close()
    return MergeResult(
        sessions,
        samples * tokens,
        statistics.median(serial_times),
        statistics.median(merged_times),
        counters,
        sessions * rounds,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model on CPU: a smoke check")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--chunk-tokens", type=int, default=4096)
    parser.add_argument("--grad-ckpt", action="store_true")
    parser.add_argument("--peak-tflops", type=float, help="dense bf16 peak of this GPU")
    parser.add_argument("--merge-only", action="store_true", help="only the merged-vs-serial row")
    parser.add_argument("--no-merge", action="store_true", help="skip the merged-vs-serial row")
    parser.add_argument("--merge-sessions", type=int, default=8)
    parser.add_argument("--merge-samples", type=int, default=4)
    parser.add_argument("--merge-tokens", type=int, default=32)
    parser.add_argument("--merge-rounds", type=int, default=10)
    parser.add_argument("--merge-window-ms", type=float, help="default: the engine's")
    parser.add_argument(
        "--vllm-python",
        help="also the vLLM rows (scripts/bench_vllm.py) on a Qwen3-0.6B shape, bf16, 64 x 512",
    )
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    if args.tiny:
        device, shape = torch.device("cpu"), TINY
        tokens, steps, warmup = min(args.tokens, 512), 1, 1
    else:
        if not torch.cuda.is_available():
            print("bench_gpu: no CUDA device (use --tiny for a CPU smoke check)", file=sys.stderr)
            return 2
        device, shape = torch.device("cuda"), QWEN3_06B
        tokens, steps, warmup = args.tokens, args.steps, args.warmup
    peak = peak_flops(device, args.peak_tflops)
    results = []
    for rank in () if args.merge_only else (None, args.lora_rank):
        mode_args = (steps, warmup, args.grad_ckpt, args.chunk_tokens)
        results.append(run_mode(shape, device, tokens, rank, *mode_args))
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the previous mode's model is gone once run_mode returns
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (tiny)"
    print(f"{name}; {shape.describe()}; bf16; peak {peak / 1e12:.1f} TFLOP/s")
    if results:
        print("| mode | tokens | step | tokens/s | TFLOP/s | MFU | peak GPU mem (GB) |")
        print("|---|---|---|---|---|---|---|")
    for result in results:
        print(result.row(peak))
    figures: dict[str, Any] = {
        "device": name,
        "shape": shape.describe(),
        "grad_ckpt": args.grad_ckpt,
        "peak_tflops": peak / 1e12,
        "modes": [result.figures(peak) for result in results],
    }
    if args.json is not None:  # written now too, so a step cut short keeps the modes' rows
        args.json.write_text(json.dumps(figures, indent=1))
    if not args.no_merge:
        rounds = 2 if args.tiny else args.merge_rounds
        merge = run_merge(
            shape,
            device,
            args.merge_sessions,
            args.merge_samples,
            args.merge_tokens,
            rounds,
            args.lora_rank,
            args.merge_window_ms,
        )
        title = f"merged vs serial forward-backward, LoRA r{args.lora_rank}"
        print(f"\n{title}, medians of {rounds} rounds")
        print(
            "| sessions x tokens/call | serial calls/s | merged calls/s | merged/serial | merged |"
        )
        print("|---|---|---|---|---|")
        print(merge.row())
        figures["merge"] = merge.figures()
        if args.json is not None:
            args.json.write_text(json.dumps(figures, indent=1))
    if args.vllm_python:
        run_vllm(args.vllm_python, device, shape, tiny=args.tiny)
    return 0


def run_vllm(python: str, device: torch.device, shape: ModelShape, tiny: bool) -> None:
    """The vLLM rows of `scripts/bench_vllm.py` (rollouts, syncs, a GRPO step, each beside the
    in-process loop) on this shape: bf16, 64 x 512 tokens on a GPU."""
    import subprocess

    size = ["--batches", "1,8", "--tokens", "8", "--runs", "1"] if tiny else []
    size = size or ["--batches", "1,8,32,64", "--tokens", "512", "--runs", "3"]
    command = [
        sys.executable,
        str(ROOT / "scripts" / "bench_vllm.py"),
        "--python",
        python,
        "--device",
        device.type,
        "--dtype",
        "float32" if tiny else "bfloat16",
        "--vocab",
        str(shape.vocab),
        "--hidden",
        str(shape.hidden),
        "--intermediate",
        str(shape.intermediate),
        "--layers",
        str(shape.layers),
        "--heads",
        str(shape.heads),
        "--kv-heads",
        str(shape.kv_heads),
        "--head-dim",
        str(max(32, shape.head_dim or shape.hidden // shape.heads)),
        *size,
    ]
    print("\nvLLM generator replicas beside the in-process loop (scripts/bench_vllm.py)")
    subprocess.run(command, check=True)


if __name__ == "__main__":
    raise SystemExit(main())
