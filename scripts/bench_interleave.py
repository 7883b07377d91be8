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

Then the coupling of batched samples: session 1 samples `--long-rows` x `--long-tokens` tokens
while session 2 samples `--short-tokens` tokens, both with `batch_samples` on. Two arms: sent at
once (one generation batch: the short sample returns once its own rows are done) and sent
`--delay` s after the long one took the lock (a generation of its own, taking turns with it);
the short sample's latency against its solo time. `--coupling-only` runs this part alone:

    python scripts/bench_interleave.py --coupling-only --long-rows 16 --long-tokens 400
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
from trainer.engine.batching.sample_batch import sample_counters
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


def coupling(
    resource: ModelResource, long: Any, short: Any, args: argparse.Namespace
) -> dict[str, float]:
    """A short sample next to a long batched one (the module docstring): medians in seconds."""
    prompt = [model_input([2, 3, 4])]
    big = SamplingParams(max_tokens=args.long_tokens, seed=0)
    small = SamplingParams(max_tokens=args.short_tokens, seed=1)
    for session in (long, short):
        session.options = EngineOptions(decode_steps_per_turn=args.steps_per_turn)

    def run_long() -> float:
        return _timed(lambda: long.sample(prompt, num_samples=args.long_rows, sampling_params=big))

    def run_short() -> float:
        return _timed(lambda: short.sample(prompt, sampling_params=small))

    def batches() -> int:
        return sample_counters(resource)["sample_batches"]

    times: dict[str, list[float]] = {"short_alone": [], "together": [], "later": [], "long": []}
    batched = 0  # runs whose "sent at once" pair shared one generation
    with ThreadPoolExecutor(1) as first, ThreadPoolExecutor(1) as second:
        for _ in range(args.runs):
            times["short_alone"].append(second.submit(run_short).result())
            before = batches()
            job, quick = first.submit(run_long), second.submit(run_short)
            times["together"].append(quick.result())
            times["long"].append(job.result())
            batched += batches() > before
            job = first.submit(run_long)
            while not resource.lock.locked():
                time.sleep(0.0005)
            time.sleep(args.delay)
            times["later"].append(second.submit(run_short).result())
            job.result()
    figures = {f"coupled_{name}_s": statistics.median(values) for name, values in times.items()}
    return {**figures, "coupled_together_batched_runs": batched}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1536, help="tokens session 1 samples")
    parser.add_argument("--runs", type=int, default=5, help="runs of each arm (median)")
    parser.add_argument("--steps-per-turn", type=int, default=16, help="K of the 'on' arm")
    parser.add_argument("--delay", type=float, default=0.1, help="s after the sample starts")
    parser.add_argument("--batch-sessions", type=int, default=4, help="sessions sampling at once")
    parser.add_argument("--batch-tokens", type=int, default=256, help="tokens each of them samples")
    parser.add_argument("--long-rows", type=int, default=64, help="rows of the long sample")
    parser.add_argument("--long-tokens", type=int, default=1500, help="its tokens per row")
    parser.add_argument("--short-tokens", type=int, default=2, help="tokens of the short sample")
    parser.add_argument("--coupling-only", action="store_true", help="only the coupling rows")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        positions = max(args.tokens, args.long_tokens) + 64
        spec = TinySpec(vocab=VOCAB, eos=None, max_positions=positions)
        model_dir = save_model(spec, Path(tmp, "model"))
        entry = ModelEntry(name="demo", location=str(model_dir), max_seq_length=positions)
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
        if args.coupling_only:
            _report_coupling(coupling(resource, s1, s2, args), args)
            return
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
        coupled = coupling(resource, s1, s2, args)

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
    _report_coupling(coupled, args)


def _report_coupling(figures: dict[str, float], args: argparse.Namespace) -> None:
    print(
        f"a {args.short_tokens}-token sample next to a {args.long_rows} x {args.long_tokens}-token "
        f"sample (medians of {args.runs} runs, turns every {args.steps_per_turn} steps): "
        f"alone {figures['coupled_short_alone_s']:.3f} s, sent at once "
        f"{figures['coupled_together_s']:.3f} s (one batch in "
        f"{figures['coupled_together_batched_runs']:.0f} of {args.runs} runs), "
        f"sent {args.delay} s in "
        f"{figures['coupled_later_s']:.3f} s; the long sample {figures['coupled_long_s']:.3f} s"
    )
    if args.json:
        path = args.json.with_suffix(".coupling.json")
        path.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
