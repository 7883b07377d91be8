"""The GPU proof's figures as BENCHMARKS.md rows: `python scripts/gpu_report.py figures.json`.

Reads the `figures.json` that `scripts/gpu_proof.sh` wrote under `$OUT` and prints markdown
tables, the GPU named in each heading, so the figures go into BENCHMARKS.md as measured. A step
that failed or was skipped prints as such, with its exit code: a failure is a figure too.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _failed(name: str, step: dict[str, Any]) -> list[str]:
    why = step.get("why") or f"rc {step.get('rc')}"
    return [f"- `{name}`: **{step['status']}** ({why}) after {step.get('seconds', 0)} s"]


def _train(name: str, figures: dict[str, Any]) -> list[str]:
    ckpt = "on" if figures.get("grad_ckpt") else "off"
    lines = [
        f"`{name}`: {figures['shape']}, bf16, activation checkpointing {ckpt}",
        "",
        "| mode | tokens | step (ms) | tokens/s | TFLOP/s | MFU | peak memory (GB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in figures["modes"]:
        lines.append(
            f"| {m['mode']} | {m['tokens']:,} | {m['step_s'] * 1e3:.0f} | "
            f"{m['tokens_per_s']:,.0f} | {m['tflops']:.1f} | {m['mfu']:.1%} | "
            f"{m['peak_mem_gb']:.1f} |"
        )
    merge = figures.get("merge")
    if merge:
        lines += [
            "",
            "| sessions x tokens/call | serial calls/s | merged calls/s | merged / serial |",
            "|---|---|---|---|",
            f"| {merge['sessions']} x {merge['call_tokens']} | "
            f"{merge['serial_calls_per_s']:.1f} | {merge['merged_calls_per_s']:.1f} | "
            f"{merge['merged_over_serial']:.2f}x |",
        ]
    return lines


def _decode(figures: dict[str, Any]) -> list[str]:
    lines = [
        f"{figures['shape_detail']}, {figures['dtype']}, attention {figures['attention']}",
        "",
        "| arm | batch | new tokens | tokens/s | ms/step | host transfers/step | CUDA syncs/step |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in figures["rows"]:
        syncs = row.get("cuda_syncs_per_step")
        lines.append(
            f"| {row['arm']} | {row['batch']} | {row['tokens']} | {row['tokens_per_s']:,.0f} | "
            f"{row['step_ms']:.2f} | {row['transfers_per_step']:.2f} | "
            f"{'-' if syncs is None else f'{syncs:.2f}'} |"
        )
    return lines


def _grammar(figures: dict[str, Any]) -> list[str]:
    """The decode loop with and without a JSON Schema (`scripts/bench_grammar.py`)."""
    lines = [
        f"{figures['shape']}, {figures['dtype']}, attention {figures['attention']}; grammar "
        f"compiled in {figures['grammar_setup_s']:.1f} s",
        "",
        "| arm | batch | tokens made | tokens/s | host transfers/step | grammar ÷ plain |",
        "|---|---|---|---|---|---|",
    ]
    plain = {r["batch"]: r for r in figures["rows"] if r["arm"] == "plain"}
    for row in figures["rows"]:
        base = plain.get(row["batch"])
        ratio = (
            f"{row['tokens_per_s'] / base['tokens_per_s']:.2f}x"
            if row["arm"] != "plain" and base
            else ""
        )
        lines.append(
            f"| {row['arm']} | {row['batch']} | {row['tokens']:.0f} | {row['tokens_per_s']:,.0f} | "
            f"{row['transfers_per_step']:.2f} | {ratio} |"
        )
    return lines


def _grpo(figures: dict[str, Any]) -> list[str]:
    lines = [
        f"{figures['shape']}, {figures['dtype']}, LoRA r{figures['rank']}, group "
        f"{figures['group']} x {figures['tokens']} tokens; median step "
        f"{figures['step_seconds_median']:.2f} s",
        "",
        "| step | seconds | sample tokens/s | reward | gap max | gap mean | ratio mean |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in figures["steps"]:
        lines.append(
            f"| {s['step']} | {s['seconds']:.2f} | {s['sample_tokens_per_s']:,.0f} | "
            f"{s['reward_mean']:.3f} | {s['gap_max']:.2e} | {s['gap_mean']:.2e} | "
            f"{s['ratio_mean']:.4f} |"
        )
    return lines


def _masters(f: dict[str, Any]) -> list[str]:
    """bf16 AdamW beside AdamW with fp32 masters (`scripts/bench_masters.py`)."""
    return [
        "`masters`: AdamW step on bf16 full weights, fp32 masters ÷ none",
        "",
        "| weights | numel | device | bf16 AdamW | + fp32 masters | ratio | widen a backward "
        "| state | with masters |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| full bf16, {f['layers']} layers | {f['numel'] / 1e6:.1f} M | {f['device']} | "
        f"{f['plain_ms']:.1f} ms | {f['masters_ms']:.1f} ms | {f['ratio']:.2f}x | "
        f"{f.get('widen_ms', float('nan')):.1f} ms | "
        f"{f['plain_state_gib']:.2f} GiB | {f['masters_state_gib']:.2f} GiB |",
    ]


def _tests(name: str, step: dict[str, Any]) -> list[str]:
    counts = ", ".join(f"{k} {step.get(k, 0)}" for k in ("tests", "failures", "errors", "skipped"))
    lines = [f"- `{name}`: {step['status']}; {counts}"]
    lines += [f"  - failed: `{t}`" for t in step.get("failed_tests", [])]
    return lines


def report(data: dict[str, Any]) -> str:
    steps = data["steps"]
    versions = steps.get("versions", {}).get("figures", {})
    gpu = versions.get("gpu") or "CPU (rehearsal)"
    lines = [
        f"GPU proof on {gpu}: {data['mode']}, {data['started']}, {data.get('seconds')} s; "
        f"torch {versions.get('torch')} (CUDA {versions.get('cuda')}), transformers "
        f"{versions.get('transformers')}, peft {versions.get('peft')}, Python "
        f"{versions.get('python')}",
        "",
    ]
    for name, step in steps.items():
        if name == "versions":
            continue
        if step["status"] != "ok" and "figures" not in step and "tests" not in step:
            lines += [*_failed(name, step), ""]
            continue
        if "tests" in step:
            lines += [*_tests(name, step), ""]
        elif name.startswith("bench_train"):
            lines += [*_train(name, step["figures"]), ""]
        elif name == "decode":
            lines += [f"`decode` ({step['status']})", "", *_decode(step["figures"]), ""]
        elif name == "masters":
            lines += [*_masters(step["figures"]), ""]
        elif name == "grammar":
            lines += [f"`grammar` ({step['status']})", "", *_grammar(step["figures"]), ""]
        elif name == "grpo":
            lines += [f"`grpo` ({step['status']})", "", *_grpo(step["figures"]), ""]
        else:
            lines += [f"- `{name}`: {step['status']}", ""]
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    print(report(json.loads(Path(sys.argv[1]).read_text())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
