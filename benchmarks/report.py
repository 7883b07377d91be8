"""The results table, the machine it ran on, and the `BENCHMARKS.md` section between markers."""

from __future__ import annotations

import os
import platform
from importlib import metadata
from pathlib import Path

from benchmarks.rows import RowResult

START = "<!-- bench:start -->"
END = "<!-- bench:end -->"
PACKAGES = ("torch", "transformers", "peft", "trl", "together")


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ram = "?"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                ram = f"{int(line.split()[1]) / 2**20:.0f} GiB RAM"
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, {ram}"


def versions() -> str:
    parts = [f"python {platform.python_version()}"]
    for name in PACKAGES:
        try:
            parts.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{name} (not installed)")
    return ", ".join(parts)


def load_average() -> str:
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return "?"
    return f"{one:.1f} / {five:.1f} / {fifteen:.1f}"


def _status(met: bool | None) -> str:
    return {True: "met", False: "MISSED", None: "not measured"}[met]


def table(rows: list[RowResult]) -> str:
    lines = [
        "| # | comparison | measured | target | status |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r.num} | {r.comparison} | {r.measured} | {r.target} | {_status(r.met)} |")
    return "\n".join(lines)


def details(rows: list[RowResult]) -> str:
    out = []
    for r in rows:
        for d in r.details:
            out.append(f"- row {r.num}: {d}")
    return "\n".join(out)


GPU_SECTION = """### GPU (`scripts/bench_gpu.py`)

| model | weights | tokens | tokens/s | MFU |
|---|---|---|---|---|
| Qwen3-0.6B-shaped, bf16 | full | 16,384 packed | not measured yet | not measured yet |
| Qwen3-0.6B-shaped, bf16 | LoRA rank 32 | 16,384 packed | not measured yet | not measured yet |

Goal: MFU ≥ 30% for full weights at 16k tokens (best published figure we know: 11% on an H100).
"""


def section(
    rows: list[RowResult], command: str, seconds: float, load: tuple[str, str], notes: str
) -> str:
    return "\n".join(
        [
            START,
            "## Performance benchmarks (CPU)",
            "",
            f"Command: `{command}` (took {seconds / 60:.1f} min).",
            "",
            f"Machine: {machine()}. Versions: {versions()}.",
            f"Load average (1/5/15 min) at start {load[0]}, at end {load[1]}: the machine is",
            "shared, so every figure is a ratio of two arms measured side by side in the same run,",
            "each arm in a fresh process, quoting the median of its repetitions.",
            "",
            table(rows),
            "",
            "Details:",
            "",
            details(rows),
            "",
            notes.strip(),
            "",
            GPU_SECTION.strip(),
            END,
        ]
    )


def write_section(path: Path, text: str) -> None:
    """Replace the text between the markers (re-reading the file first); append if missing."""
    current = path.read_text() if path.exists() else ""
    if START in current and END in current:
        head, rest = current.split(START, 1)
        _, tail = rest.split(END, 1)
        new = head + text + tail
    else:
        sep = "\n" if current.endswith("\n") else "\n\n"
        new = (current + sep if current else "") + text + "\n"
    path.write_text(new)
