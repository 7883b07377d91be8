"""`scripts/bench.py`: run the rows, print the table, update BENCHMARKS.md."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from benchmarks import report
from benchmarks.rows import ROWS, Context, RowResult

ROOT = Path(__file__).resolve().parents[1]

NOTES = """Notes on method and on the rows:

- Peak memory: the process's resident-set high-water mark (`VmHWM`, reset through
  `/proc/self/clear_refs` right before the measured steps) minus the resident set at that
  moment (rows 1, 2), or minus the bare process after imports (row 8: weights, gradients,
  AdamW moments and activations all count). It sees every byte, allocator slack included;
  CPU torch has no allocator counter and `tracemalloc` does not see tensor storage.
- Row 1: our head keeps one `[1024, V]` fp32 chunk alive (forward: logits → in-place
  exp; backward: recomputed logits → in-place `g·(onehot − softmax)`), so its peak is one
  chunk (~0.6 GB) whatever T is; the naive path holds three `[T, V]` fp32 tensors. The time
  ratio is close to 1 because the backward recomputes the chunk's matmul (4 head matmuls
  instead of 3) while doing fewer passes over `[T, V]` than autograd does.
- Row 2: TRL runs its own `GRPOTrainer` (built normally, with its fused LM head patched in)
  through `compute_loss` + `backward` on the same weights and batch. On CPU TRL's head is its
  torch fallback and scores every position, prompt and padding included (its Triton kernels,
  which skip masked positions, exist only on CUDA/XPU); ours drops them before the head and
  packs without padding. The GPU comparison is still to be made.
- Row 3: model FLOPs only (6·N·T + attention; the head's recompute is not counted), divided
  by the best of three 2048³ fp32 matmuls measured in the same process between steps.
- Row 4: "packed" is `pack` fed as one unpadded row to `packed_sdpa` (per-sample causal SDPA,
  the exact CPU stand-in for FlashAttention varlen; `trainer/compute/batch.py`), which is what the
  engine's session runs (`MicroBatch.decoder_inputs`). The detail line shows the alternative
  it replaced: rows of 2048 with a dense block-diagonal mask (0.46x–1.22x the padded speed
  across runs: attention over the whole row). Both arms drop masked positions before the
  head, so only the decoder differs; the row uses a decoder-dominated shape.
- Row 6: a training checkpoint writes each file with `save_tensors` straight from the live
  weights and AdamW moments under the session lock (no copy-out; from an accelerator one tensor
  at a time comes to the CPU), largest file first; each file's fsync and sha256 (read back from
  the page cache through a mapping) start in threads as soon as it closes, and finish after the
  lock is released; then the directories, manifest, rename and catalogue. The raw arm is one
  `write` + `fsync` of the same byte count; the baseline arm, run interleaved in the same
  process, is the path before (a clone of every tensor under the lock, safetensors' `save_file`,
  then fsync ∥ sha256 of all files). Profile (per-run medians, ms, range over three runs):
  baseline copy-out 436–675, `save_file` 157–751, fsync ∥ sha256 424–654, directory fsyncs +
  manifest + rename 13–18, SQLite insert 1–2; ours copy-out 0, writes 208–691 (the lock hold
  time, comparable to the baseline's copy-out), wait for fsync ∥ sha256 321–498, directory
  fsyncs + manifest + rename 10–18, SQLite 1–3. safetensors 0.8 serialises from the tensors'
  pointers (no copy), but one `write` per tensor took half its time on the same 348 MB measured
  alone. What remains is necessary: every byte is written once (what the raw arm does) and
  hashed once for the manifest, and sha256 ran at 478–697 MB/s during the runs against 606–858
  MB/s for raw write + fsync. With both cores taken by other work the hash cannot hide behind
  the writes, which bounds the ratio near 0.45–0.55; with a free core it overlaps them. The
  directory and SQLite fsyncs are under 3%. Met: 0.45 / 0.51 / 0.53 in three runs (baseline 0.24
  / 0.26 / 0.42 in the same runs), load average 4.2–5.6 on 2 cores, 2026-12-01: a noisy row, at
  the target rather than above it.
- Row 7: the SDK polls the operation every 20 ms; the server is a separate process on the
  same two cores.
"""


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,3,4,5,6,7,8", help="comma-separated row numbers")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, in-process, 1 rep")
    parser.add_argument("--inprocess", action="store_true", help="run arms in this process")
    parser.add_argument("--no-write", action="store_true", help="do not touch BENCHMARKS.md")
    parser.add_argument("--output", type=Path, default=ROOT / "BENCHMARKS.md")
    parser.add_argument("--workdir", type=Path, help="where models and checkpoints go (temp)")
    parser.add_argument("--save-json", type=Path, help="also save the results here")
    parser.add_argument("--from-json", type=Path, help="render saved results, measure nothing")
    return parser.parse_args(argv)


def measure_rows(
    args: argparse.Namespace, wanted: list[int]
) -> tuple[list[RowResult], float, tuple[str, str]]:
    started, load_start = time.perf_counter(), report.load_average()
    with tempfile.TemporaryDirectory(prefix="trainer-bench-", dir=args.workdir) as tmp:
        ctx = Context(quick=args.quick, inprocess=args.quick or args.inprocess, workdir=Path(tmp))
        results: list[RowResult] = []
        for num in wanted:
            print(f"row {num}", flush=True)
            results.append(ROWS[num](ctx))
            print(f"  -> {results[-1].measured}", flush=True)
    return results, time.perf_counter() - started, (load_start, report.load_average())


def main(argv: Sequence[str] | None = None, prog: str = "python scripts/bench.py") -> int:
    """Run the rows named by `argv` (see `--help`); `prog` is how the command is quoted."""
    args = parse(argv)
    wanted = [int(x) for x in args.rows.split(",") if x.strip()]
    unknown = [n for n in wanted if n not in ROWS]
    if unknown:
        print(f"bench: unknown rows {unknown}; known: {sorted(ROWS)}", file=sys.stderr)
        return 2
    command = f"{prog} " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        results = [RowResult(**r) for r in saved["rows"]]
        command, elapsed, loads = saved["command"], saved["seconds"], tuple(saved["load"])
    else:
        results, elapsed, loads = measure_rows(args, wanted)
    if args.save_json:
        payload = {
            "rows": [asdict(r) for r in results],
            "command": command.strip(),
            "seconds": elapsed,
            "load": list(loads),
        }
        args.save_json.write_text(json.dumps(payload, indent=2))
    print()
    print(report.table(results))
    print(report.details(results))
    print(f"\n{elapsed:.0f} s; {report.machine()}; {report.versions()}")
    if not (args.quick or args.no_write):
        text = report.section(results, command.strip(), elapsed, (loads[0], loads[1]), NOTES)
        report.write_section(args.output, text)
        print(f"wrote {args.output}")
    return 0
