"""Latency of a small forward-backward sent while another session samples.

    python scripts/bench_interleave.py                      # demo-sized model, 1,536 tokens
    python scripts/bench_interleave.py --tokens 512 --runs 3 --steps-per-turn 8

One LoRA resource on the demo-sized model (Qwen3-shaped, hidden 64, 2 layers, 4 heads, a
16-token vocabulary; no EOS, so every sample runs to `--tokens`), two sessions. Session 1
samples `--tokens` tokens; `--delay` seconds after it has taken the compute lock, session 2
sends a forward-backward of 4 x 32 tokens, and we time it until it returns. Two arms, run
alternately on the same sessions: turns on (`[engine] decode_steps_per_turn`, the sample
yields every K decode steps to waiting operations) and off (K = 0: the sample holds the lock
for its whole generation, the behaviour before). Medians of `--runs` runs of each, with the
forward-backward alone and the sample alone (with turns on and nobody waiting: the cost of the
check) for reference.

Then `--batch-sessions` sessions each sample `--batch-tokens` tokens at once, each from its own
thread: one generation batch (`[engine] batch_samples` on,
`trainer/engine/batching/sample_batch.py`) vs one
generation per session taking turns on the lock (off); wall time until all are done.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from trainer.checkpoint.store import CheckpointStore
from trainer.contract.options import EngineOptions
from trainer.contract.specs import (
    AdamParams,
    EncodedTextChunk,
    LoraConfig,
    LossConfig,
    ModelEntry,
    ModelInput,
    ModelInputChunk,
    ResourceSpec,
    Sample,
    SamplingParams,
    SessionSpec,
    TensorData,
)
from trainer.engine.resource import ModelResource
from trainer.tiny import TinySpec, save_model

CE = LossConfig(type="cross_entropy")
VOCAB = 16


def model_input(tokens: list[int]) -> ModelInput:
    return ModelInput(chunks=[ModelInputChunk(encoded_text=EncodedTextChunk(tokens=tokens))])


def small_batch(n: int = 4, length: int = 32) -> list[Sample]:
    """`n` random samples of `length` tokens, cross entropy on every one."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        seq = torch.randint(2, VOCAB, (length + 1,), generator=gen).tolist()
        inputs = {
            "target_tokens": TensorData(data=seq[1:], dtype="int64"),
            "weights": TensorData(data=[1.0] * length, dtype="float32"),
        }
        out.append(Sample(model_input=model_input(seq[:-1]), loss_fn_inputs=inputs))
    return out


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1536, help="tokens session 1 samples")
    parser.add_argument("--runs", type=int, default=5, help="runs of each arm (median)")
    parser.add_argument("--steps-per-turn", type=int, default=16, help="K of the 'on' arm")
    parser.add_argument("--delay", type=float, default=0.1, help="s after the sample starts")
    parser.add_argument("--batch-sessions", type=int, default=4, help="sessions sampling at once")
    parser.add_argument("--batch-tokens", type=int, default=256, help="tokens each of them samples")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        spec = TinySpec(vocab=VOCAB, eos=None, max_positions=args.tokens + 64)
        model_dir = save_model(spec, Path(tmp, "model"))
        entry = ModelEntry(name="demo", location=str(model_dir), max_seq_length=args.tokens + 64)
        resource = ModelResource(
            entry,
            ResourceSpec(
                base_model="demo", lora_enabled=True, compute_config={"num_generator_replicas": 1}
            ),
            CheckpointStore(Path(tmp, "store")),
            device="cpu",
        )
        s1, s2 = (
            resource.create_session(name, SessionSpec(lora_config=LoraConfig(rank=8, seed=i)))
            for i, name in enumerate(("a", "b"))
        )
        batch = small_batch()
        for session in (s1, s2):
            session.forward_backward(CE, batch)
            session.optim_step(AdamParams(learning_rate=0.01))
            session.weights_sync("WEIGHT_SYNC_TYPE_SYNCHRONOUS")
        prompt = [model_input([2, 3, 4])]
        params = SamplingParams(max_tokens=args.tokens, seed=0)
        arms = {"on": args.steps_per_turn, "off": 0}

        def sample() -> float:
            return _timed(lambda: s1.sample(prompt, sampling_params=params))

        def fb() -> float:
            return _timed(lambda: s2.forward_backward(CE, batch))

        # each session's work runs in a thread of its own, as the worker's session queues do
        with ThreadPoolExecutor(1) as sampler, ThreadPoolExecutor(1) as trainer:

            def race() -> tuple[float, float]:
                job = sampler.submit(sample)
                while not resource.lock.locked():
                    time.sleep(0.0005)
                time.sleep(args.delay)
                latency = trainer.submit(fb).result()
                return latency, job.result()

            sampler.submit(
                lambda: s1.sample(
                    prompt, sampling_params=params.model_copy(update={"max_tokens": 64})
                )
            ).result()  # warm-up
            fb_alone = [trainer.submit(fb).result() for _ in range(args.runs)]
            solo: dict[str, list[float]] = {arm: [] for arm in arms}
            latency: dict[str, list[float]] = {arm: [] for arm in arms}
            sample_time: dict[str, list[float]] = {arm: [] for arm in arms}
            for _ in range(args.runs):
                for arm, steps in arms.items():
                    s1.options = EngineOptions(decode_steps_per_turn=steps)
                    solo[arm].append(sampler.submit(sample).result())
                    lat, total = race()
                    latency[arm].append(lat)
                    sample_time[arm].append(total)

        # N sessions sample at once: one generation batch vs one generation each, taking turns
        more = [
            resource.create_session(
                f"c{i}", SessionSpec(lora_config=LoraConfig(rank=8, seed=9 + i))
            )
            for i in range(max(0, args.batch_sessions - 2))
        ]
        together = [s1, s2, *more][: args.batch_sessions]
        each = SamplingParams(max_tokens=args.batch_tokens, seed=1)
        walls: dict[str, list[float]] = {"batched": [], "turns": []}
        with ThreadPoolExecutor(len(together)) as pool:
            for _ in range(args.runs):
                for arm in walls:
                    for session in together:
                        session.options = EngineOptions(batch_samples=arm == "batched")
                    start = time.perf_counter()
                    jobs = [
                        pool.submit(session.sample, prompt, sampling_params=each)
                        for session in together
                    ]
                    for job in jobs:
                        job.result()
                    walls[arm].append(time.perf_counter() - start)

    med = statistics.median
    figures = {
        "tokens": args.tokens,
        "steps_per_turn": args.steps_per_turn,
        "runs": args.runs,
        "fb_alone_s": med(fb_alone),
        **{f"sample_alone_{arm}_s": med(solo[arm]) for arm in arms},
        **{f"fb_latency_{arm}_s": med(latency[arm]) for arm in arms},
        **{f"sample_with_fb_{arm}_s": med(sample_time[arm]) for arm in arms},
    }
    for arm, times in walls.items():
        figures[f"{arm}_{args.batch_sessions}x{args.batch_tokens}_s"] = med(times)
        figures[f"{arm}_tokens_per_s"] = args.batch_sessions * args.batch_tokens / med(times)
    for arm in arms:
        figures[f"fb_latency_over_sample_{arm}"] = (
            figures[f"fb_latency_{arm}_s"] / figures[f"sample_with_fb_{arm}_s"]
        )
    print(
        f"demo-sized model, session 1 samples {args.tokens} tokens, session 2 sends a "
        f"4 x 32 forward-backward {args.delay} s in; medians of {args.runs} runs; "
        f"torch threads {torch.get_num_threads()}"
    )
    print(f"  forward-backward alone                {figures['fb_alone_s']:8.3f} s")
    for arm in arms:
        label = f"turns every {arms[arm]} steps" if arms[arm] else "turns off (before)"
        print(
            f"  {label:<22} fb latency {figures[f'fb_latency_{arm}_s']:8.3f} s of a "
            f"{figures[f'sample_with_fb_{arm}_s']:.3f} s sample "
            f"({figures[f'fb_latency_over_sample_{arm}']:.1%}); "
            f"sample alone {figures[f'sample_alone_{arm}_s']:.3f} s"
        )
    print(
        f"{args.batch_sessions} sessions sample {args.batch_tokens} tokens each, at once: "
        f"one batch {med(walls['batched']):.3f} s "
        f"({figures['batched_tokens_per_s']:.0f} tok/s), taking turns {med(walls['turns']):.3f} s "
        f"({figures['turns_tokens_per_s']:.0f} tok/s): "
        f"{med(walls['turns']) / med(walls['batched']):.2f}x"
    )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
