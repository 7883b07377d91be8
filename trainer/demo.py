"""`trainer demo`: GRPO on a tiny model, end to end through the HTTP API, showing it learn.

    trainer demo --out runs/demo                       # the default recipe (configs/demo.toml)
    python -m trainer.demo --out runs/demo --steps 5   # a quick look
    trainer demo --out runs/qwen --config configs/qwen3_0.6b_lora.toml --device cuda

What happens:
1. a tiny model is built from the recipe's config (random weights, no download) into OUT/model;
2. a worker starts as a child process (`python -m trainer serve` on a free loopback port, with
   a random token in TRAINER_API_TOKEN), logging to OUT/worker.log;
3. the official `together` SDK drives it: model resource → session → the GRPO loop of
   `trainer.rl.loop` (sample → reward → advantages → forward-backward → optim-step →
   weights-sync) → training and inference checkpoints;
4. OUT gets `metrics.jsonl`, `curves.png`, `config.json` (the resolved recipe),
   `checkpoints.json` and `summary.json`.

Only `--out`, `--steps`, `--config` and `--device` are flags; everything else is the recipe.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any

from trainer.rl.config import Recipe, load_recipe
from trainer.spawn import WorkerProcess, free_port

LINE = "step {step:4d} | reward {r:.3f} ± {rs:.3f} | loss {loss:+.4f} | kl {kl:.4f} | "
LINE += "grad_norm {gn:.3f} | tok/s {tps:6.0f} | version {v}"


def step_line(m: dict[str, Any]) -> str:
    """`step 12 | reward … | loss … | kl … | grad_norm … | tok/s … | version …`"""
    return LINE.format(
        step=m["step"],
        r=m["reward/mean"],
        rs=m["reward/std"],
        loss=m["loss"],
        kl=m["kl"],
        gn=m["grad_norm"],
        tps=m["tokens_per_s"],
        v=m["weights_version"],
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--steps", type=int, help="override loop.steps of the recipe")
    parser.add_argument(
        "--config", type=Path, help="TOML recipe (default: the built-in demo recipe)"
    )
    parser.add_argument("--device", help="worker device, e.g. cpu or cuda (default: auto)")


# --------------------------------------------------------------------------------------------
# The worker, as a child process
# --------------------------------------------------------------------------------------------


def _serve_config(recipe: Recipe, location: str, storage: Path, port: int) -> str:
    m = recipe.model
    lines = [
        'host = "127.0.0.1"',
        f"port = {port}",
        f"storage = {json.dumps(str(storage))}",
        "",
        "[[model]]",
        f"name = {json.dumps(m.name)}",
        f"location = {json.dumps(location)}",
        f"max_seq_length = {m.max_seq_length}",
        f"max_batch_size = {m.max_batch_size}",
        f"max_lora_rank = {m.max_lora_rank}",
        f'dtype = "{m.dtype}"',
    ]
    if recipe.device:
        lines.insert(3, f"device = {json.dumps(recipe.device)}")
    return "\n".join(lines) + "\n"


def start_worker(recipe: Recipe, location: str, out: Path) -> tuple[WorkerProcess, str]:
    """`python -m trainer serve --config OUT/serve.toml` on a free port, with a random token in
    TRAINER_API_TOKEN, logging to OUT/worker.log; (the worker, its token)."""
    token = secrets.token_urlsafe(24)
    port = free_port()
    config = out / "serve.toml"
    config.write_text(_serve_config(recipe, location, out / "worker", port))
    env = dict(os.environ, TRAINER_API_TOKEN=token)
    if recipe.model.source == "tiny":
        env.setdefault("OMP_NUM_THREADS", "1")  # a tiny model runs faster on one thread
    command = [sys.executable, "-m", "trainer", "serve", "--config", str(config)]
    command += ["--log-level", "warning"]
    return WorkerProcess(command, port, out / "worker.log", env), token


# --------------------------------------------------------------------------------------------
# Outputs
# --------------------------------------------------------------------------------------------


def plot(history: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in history]
    mean = [m["reward/mean"] for m in history]
    std = [m["reward/std"] for m in history]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot(steps, mean, label="reward (mean)")
    top.fill_between(
        steps, [a - b for a, b in zip(mean, std)], [a + b for a, b in zip(mean, std)], alpha=0.2
    )
    top.axhline(0.8, color="grey", linestyle="--", linewidth=0.8, label="0.8")
    top.set_ylabel("reward")
    top.set_ylim(-0.05, 1.05)
    top.legend(loc="lower right")
    bottom.plot(steps, [m["loss"] for m in history], color="tab:red")
    bottom.set_ylabel("loss")
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def summarize(history: list[dict[str, Any]], wall_s: float, eval_reward: float) -> dict[str, Any]:
    rewards = [m["reward/mean"] for m in history]
    head, tail = rewards[: min(5, len(rewards))], rewards[-min(10, len(rewards)) :]
    return {
        "steps": len(history),
        "reward/first5": sum(head) / len(head),
        "reward/last10": sum(tail) / len(tail),
        "reward/max": max(rewards),
        "reward/greedy_eval": None if math.isnan(eval_reward) else eval_reward,
        "weights_version": history[-1]["weights_version"],
        "wall_s": wall_s,
    }


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


def _session_settings(recipe: Recipe) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    r = recipe.resource
    lora = {
        "rank": r.lora_rank,
        "alpha": r.lora_alpha,
        "train_unembed": r.train_unembed,
        "seed": r.lora_seed if r.lora_seed is not None else recipe.seed,
    }
    w = recipe.wandb
    metadata = None
    if w.project:
        wandb = {"project": w.project, "entity": w.entity, "group": w.group, "run_name": w.run_name}
        metadata = {"wandb": {k: v for k, v in wandb.items() if v}}
    return (lora if r.lora else None), metadata


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from trainer.engine import tracking
    from trainer.rl.client import HttpClient
    from trainer.rl.loop import RLLoop
    from trainer.rl.tasks import make_task
    from trainer.tiny import save_model

    started = time.perf_counter()
    for name in ("httpx", "together"):  # one line per step, not one per HTTP request
        logging.getLogger(name).setLevel(logging.WARNING)
    recipe = load_recipe(args.config, {"loop.steps": args.steps, "device": args.device})
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(recipe.model_dump_json(indent=2) + "\n")
    if recipe.model.source == "tiny":
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        seed = recipe.model.init_seed
        location = str(save_model(recipe.model.tiny_spec(), out / "model", seed).resolve())
        tokenizer = None
    else:
        location = recipe.model.location or ""
        tokenizer = _load_tokenizer(location)
    task = make_task(recipe.task, tokenizer, recipe.sampling.max_tokens)

    print(f"starting the worker ({recipe.model.name}) ...", flush=True)
    worker, token = start_worker(recipe, location, out)
    client = None
    tracker = None
    metrics_file = (out / "metrics.jsonl").open("w")
    try:
        worker.wait_ready(timeout=180.0, interval=0.2)
        lora, metadata = _session_settings(recipe)
        client = HttpClient(
            f"{worker.url}/v1",
            token,
            base_model=recipe.model.name,
            lora=recipe.resource.lora,
            lora_config=lora,
            metadata=metadata,
            display_name=f"demo-{task.name}",
            optimizer_config=recipe.resource.optimizer_config(),
        )
        tracker = tracking.open_run(metadata, recipe.model_dump(), directory=str(out))
        print(
            f"worker up at {worker.url} in {time.perf_counter() - started:.1f}s; "
            f"session {client.session_id}; task {task.name}, {recipe.loop.objective} "
            f"{recipe.loop.mode}, {recipe.loop.prompts_per_step}x{recipe.loop.group_size}",
            flush=True,
        )
        loop = RLLoop(client, task, recipe)
        bar = tqdm(total=recipe.loop.steps, desc="training", unit="step", dynamic_ncols=True)

        def on_step(m: dict[str, Any]) -> None:
            metrics_file.write(json.dumps(m) + "\n")
            metrics_file.flush()
            if tracker is not None:
                tracker.log(m["step"], m)
            if m["step"] % recipe.loop.log_every == 0 or m["step"] == recipe.loop.steps:
                bar.write(step_line(m))
            bar.set_postfix(reward=f"{m['reward/mean']:.3f}")
            bar.update(1)

        history = loop.run(on_step)
        bar.close()
        eval_reward = loop.evaluate(recipe.task.eval_prompts)
        training_id, inference_id = client.checkpoints()
        (out / "checkpoints.json").write_text(
            json.dumps(
                {"training_checkpoint_id": training_id, "inference_checkpoint_id": inference_id},
                indent=2,
            )
            + "\n"
        )
        plot(history, out / "curves.png")
        summary = summarize(history, time.perf_counter() - started, eval_reward)
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        _print_summary(summary, training_id, inference_id, out)
    finally:
        metrics_file.close()
        if tracker is not None:
            tracker.finish()
        if client is not None:
            client.close()
        worker.stop()
    return 0


def _load_tokenizer(location: str) -> Any:
    from transformers import AutoTokenizer

    from trainer.compute.model import local_dir

    return AutoTokenizer.from_pretrained(str(local_dir(location)))


def _print_summary(summary: dict[str, Any], training_id: str, inference_id: str, out: Path) -> None:
    greedy = summary["reward/greedy_eval"]
    print(
        f"\ndone: {summary['steps']} steps in {summary['wall_s']:.0f}s | reward "
        f"{summary['reward/first5']:.3f} (first {min(5, summary['steps'])}) → "
        f"{summary['reward/last10']:.3f} (last {min(10, summary['steps'])})"
        + (f" | greedy eval {greedy:.3f}" if greedy is not None else "")
        + f" | weights version {summary['weights_version']}"
    )
    print(f"checkpoints: training {training_id}, inference {inference_id}")
    print(f"wrote {out}/metrics.jsonl, curves.png, config.json, checkpoints.json, summary.json")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trainer demo", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
