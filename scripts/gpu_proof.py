"""The first-GPU proof: every measurement the GPU tables need, in one timed run (see gpu_proof.sh).

    python scripts/gpu_proof.py --out DIR [--rehearse] [--budget SECONDS]

Runs each step as its own process with a time cap, keeps going past a failing step (its exit
code and log tail are figures too), and rewrites `DIR/figures.json` after every step, so a run
cut short still leaves what it measured. Every step's output is collected into `DIR/proof.log`.
`--rehearse` runs the same steps on the CPU with tiny shapes and skips the GPU-only ones, so a
CPU test (`tests/perf/test_gpu_proof.py`) keeps the script from rotting. Standard library only:
it must start on a machine where nothing else was installed yet.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
LOG_TAIL = 200_000  # characters of each step's log kept in proof.log

# the engine tests that run on the device (`TRAINER_TEST_DEVICE`, tests/engine/helpers.py)
ENGINE_TESTS = [
    "tests/engine/test_session.py",
    "tests/engine/test_logprobs.py",
    "tests/engine/test_losses.py",
    "tests/engine/test_sample_extras.py",
    "tests/engine/test_sample_isolation.py",
    "tests/engine/test_multilora.py",
    "tests/engine/test_merge.py",
    "tests/engine/test_routing_replay.py",
    "tests/engine/test_decode_transfers.py",
    "tests/engine/test_embeddings.py",
]

VERSIONS = """
import json, platform, torch, transformers
try:
    import peft; peft_version = peft.__version__
except ImportError:
    peft_version = None
cuda = torch.cuda.is_available()
print(json.dumps({
    "python": platform.python_version(),
    "torch": torch.__version__,
    "cuda": torch.version.cuda,
    "transformers": transformers.__version__,
    "peft": peft_version,
    "gpu": torch.cuda.get_device_name() if cuda else None,
    "gpu_memory_gib": torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else None,
}))
"""


@dataclass
class Step:
    """One step: its command on the GPU, and on the CPU when rehearsing (None: GPU-only)."""

    name: str
    cap_s: int
    gpu: list[str]
    cpu: list[str] | None
    env: dict[str, str] = field(default_factory=dict)
    json_out: bool = False  # run with `--json {work}/{name}.json` (its figures)
    junit: bool = False  # a pytest run, with `--junitxml={work}/{name}.xml` (its counts)


def pytest(*args: str) -> list[str]:
    return [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]


def steps() -> list[Step]:
    decode_gpu = ["--device", "cuda", "--dtype", "bfloat16", "--shape", "qwen3-0.6b"]
    decode_cpu = ["--device", "cpu", "--dtype", "float32", "--shape", "tiny"]
    grpo_gpu = ["--device", "cuda", "--dtype", "bfloat16", "--shape", "qwen3-0.6b"]
    grpo_cpu = ["--device", "cpu", "--dtype", "float32", "--shape", "tiny", "--tokens", "16"]
    bench = [PY, str(ROOT / "scripts" / "bench_gpu.py")]
    decode = [PY, str(ROOT / "scripts" / "bench_decode.py")]
    grpo = [PY, str(ROOT / "scripts" / "gpu_grpo.py")]
    masters = [PY, str(ROOT / "scripts" / "bench_masters.py")]
    grammar = [PY, str(ROOT / "scripts" / "bench_grammar.py")]
    cuda = {"TRAINER_TEST_DEVICE": "cuda"}
    return [
        Step("versions", 30, [PY, "-c", VERSIONS], [PY, "-c", VERSIONS]),
        Step(
            "gpu_tests",
            45,
            pytest("-m", "gpu", "tests/perf"),
            pytest("-m", "gpu", "tests/perf"),
            junit=True,
        ),
        Step(
            "bench_train",
            80,
            bench,
            [*bench, "--tiny"],
            json_out=True,
        ),
        Step(
            "bench_train_grad_ckpt",
            50,
            [*bench, "--grad-ckpt", "--no-merge"],
            [*bench, "--tiny", "--grad-ckpt", "--no-merge"],
            json_out=True,
        ),
        Step(
            "decode",
            150,
            [
                *decode,
                *decode_gpu,
                "--baseline",
                "--batches",
                "1,8,64",
                "--tokens",
                "512",
                "--repeats",
                "1",
            ],
            [
                *decode,
                *decode_cpu,
                "--baseline",
                "--batches",
                "1,8",
                "--tokens",
                "16",
                "--repeats",
                "1",
            ],
            json_out=True,
        ),
        Step(
            "grpo",
            100,
            [*grpo, *grpo_gpu],
            [*grpo, *grpo_cpu, "--steps", "2", "--group", "4"],
            json_out=True,
        ),
        Step(
            "engine_tests_cuda",
            60,
            pytest(*ENGINE_TESTS, "-m", "not distributed and not slow"),
            pytest(*ENGINE_TESTS, "--collect-only"),
            env=cuda,
            junit=True,
        ),
        Step(
            "conformance_cuda",
            60,
            pytest("tests/models/test_conformance.py"),
            pytest("tests/models/test_conformance.py", "--collect-only"),
            env=cuda,
            junit=True,
        ),
        Step(
            "grammar",
            40,
            [*grammar, *decode_gpu, "--batches", "1,8,64", "--tokens", "128", "--repeats", "1"],
            [*grammar, *decode_cpu, "--batches", "1,8", "--tokens", "8", "--repeats", "1"],
            json_out=True,
        ),
        Step(
            "masters",
            40,
            [*masters, "--device", "cuda"],
            [*masters, "--device", "cpu", "--layers", "1", "--steps", "1", "--warmup", "0"],
            json_out=True,
        ),
    ]


def junit_counts(path: Path) -> dict[str, Any]:
    """A pytest run's counts and its first failures, from its JUnit XML."""
    if not path.exists():
        return {}
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors")}
    counts["skipped"] = sum(int(s.get("skipped", 0)) for s in suites)
    failed = []
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(f"{case.get('classname')}::{case.get('name')}")
    counts["failed_tests"] = failed[:40]
    return counts


def run_step(step: Step, rehearse: bool, work: Path, left_s: float) -> dict[str, Any]:
    command = step.cpu if rehearse else step.gpu
    if command is None:
        return {"status": "skipped", "why": "GPU-only"}
    if step.json_out:
        command = [*command, "--json", str(work / f"{step.name}.json")]
    if step.junit:
        command = [*command, f"--junitxml={work / step.name}.xml"]
    cap = min(step.cap_s, left_s)
    if cap < 10:
        return {"status": "skipped", "why": "out of time"}
    env = {**os.environ, **({} if rehearse else step.env)}
    log = work / f"{step.name}.log"
    start = time.monotonic()
    with log.open("w") as handle:
        try:
            rc = subprocess.run(
                command, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, timeout=cap
            ).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    figures: dict[str, Any] = {
        "status": "ok" if rc == 0 else ("timed out" if rc == 124 else "failed"),
        "rc": rc,
        "seconds": round(time.monotonic() - start, 1),
        "command": " ".join(command[1:]),
    }
    if step.json_out and (work / f"{step.name}.json").exists():
        figures["figures"] = json.loads((work / f"{step.name}.json").read_text())
    if step.junit:
        figures.update(junit_counts(work / f"{step.name}.xml"))
    if step.name == "versions" and rc == 0:
        figures["figures"] = json.loads(log.read_text().strip().splitlines()[-1])
    if rc != 0:
        figures["log_tail"] = log.read_text(errors="replace")[-2000:]
    return figures


def write_outputs(out: Path, work: Path, report: dict[str, Any]) -> None:
    (out / "figures.json").write_text(json.dumps(report, indent=1))
    with (out / "proof.log").open("w") as handle:
        for name in report["steps"]:
            log = work / f"{name}.log"
            text = log.read_text(errors="replace") if log.exists() else ""
            handle.write(f"===== {name} ({report['steps'][name]['status']}) =====\n")
            handle.write(text[-LOG_TAIL:] + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rehearse", action="store_true", help="CPU, tiny shapes, GPU-only off")
    parser.add_argument("--budget", type=float, default=470.0, help="seconds for all steps")
    parser.add_argument("--only", help="comma-separated step names")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-proof-"))
    deadline = time.monotonic() + args.budget
    report: dict[str, Any] = {
        "mode": "rehearsal (CPU)" if args.rehearse else "GPU",
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "budget_s": args.budget,
        "steps": {},
    }
    wanted = set(args.only.split(",")) if args.only else None
    for step in steps():
        if wanted is not None and step.name not in wanted:
            continue
        print(f"gpu_proof: {step.name} ...", flush=True)
        result = run_step(step, args.rehearse, work, deadline - time.monotonic())
        report["steps"][step.name] = result
        print(f"gpu_proof: {step.name}: {result['status']}", flush=True)
        write_outputs(args.out, work, report)
    report["seconds"] = round(args.budget - (deadline - time.monotonic()), 1)
    report["failed"] = [
        n for n, s in report["steps"].items() if s["status"] not in ("ok", "skipped")
    ]
    write_outputs(args.out, work, report)
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"failed": report["failed"], "seconds": report["seconds"]}))
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
