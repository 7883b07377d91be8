"""`scripts/bench.py --quick` runs end to end (no timing assertions: targets live in
BENCHMARKS.md)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_script", ROOT / "scripts" / "bench.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_quick_runs(tmp_path: Path, capsys) -> None:
    out = tmp_path / "BENCHMARKS.md"
    code = _bench().main(["--quick", "--rows", "1,4,5,6,8", "--workdir", str(tmp_path)])
    assert code == 0
    printed = capsys.readouterr().out
    for num in (1, 4, 5, 6, 8):
        assert f"| {num} |" in printed
    assert not out.exists()


def test_section_replaces_only_between_markers(tmp_path: Path) -> None:
    from benchmarks.report import END, START, write_section

    path = tmp_path / "BENCHMARKS.md"
    path.write_text("# Bench\n\n## Demo\nkeep me\n")
    write_section(path, f"{START}\nfirst\n{END}")
    write_section(path, f"{START}\nsecond\n{END}")
    text = path.read_text()
    assert text.startswith("# Bench\n\n## Demo\nkeep me\n")
    assert "second" in text and "first" not in text and text.count(START) == 1


def test_bench_gpu_tiny_runs_on_cpu(capsys, monkeypatch) -> None:
    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "scripts" / "bench_gpu.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_gpu", module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    assert module.main(["--tiny"]) == 0
    out = capsys.readouterr().out
    assert "| full |" in out and "| LoRA r32 |" in out
    assert "merged vs serial" in out and "| 8 x 128 |" in out  # the issue-14 row ran


def test_bench_gpu_peaks_match_the_most_specific_name(monkeypatch) -> None:
    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "scripts" / "bench_gpu.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_gpu", module)
    spec.loader.exec_module(module)
    # torch.cuda.get_device_name's spellings; the figures are NVIDIA's dense bf16 datasheet peaks
    assert module.peak_tflops_of("NVIDIA H100 80GB HBM3") == 989.4
    assert module.peak_tflops_of("NVIDIA H100 PCIe") == 756.0
    assert module.peak_tflops_of("NVIDIA H100 NVL") == 835.5
    assert module.peak_tflops_of("NVIDIA H200") == 989.4
    assert module.peak_tflops_of("NVIDIA B200") == 2250.0
    assert module.peak_tflops_of("NVIDIA GB200") == 2500.0
    assert module.peak_tflops_of("NVIDIA GeForce RTX 4090") is None
