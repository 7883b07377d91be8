"""The README's supported-models table, generated from the conformance rows and the models as
the worker loads them (`python -m tests.models.readme_table --write` rewrites it;
`test_conformance.py` checks that it is current)."""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

import torch

from tests.models.conformance import ROWS, save
from trainer.compute.model import load_base_model
from trainer.compute.selfcheck import ModelRefused
from trainer.contract.specs import ModelEntry

README = Path(__file__).resolve().parents[2] / "README.md"
BEGIN, END = "<!-- supported-models:begin -->", "<!-- supported-models:end -->"
HEADER = (
    "| family | model type | what decides its path | trainer path (CPU) | status |\n"
    "|---|---|---|---|---|"
)


def table(root: Path) -> str:
    lines = [HEADER]
    for row in ROWS:
        model_dir = save(row.family, root / row.family)
        entry = ModelEntry(name=row.family, location=str(model_dir))
        try:
            model, _ = load_base_model(entry, torch.device("cpu"))
        except ModelRefused as exc:
            found = re.search(r"model type '([^']+)'", str(exc))
            model_type = found.group(1) if found else "?"
            lines.append(f"| {row.family} | `{model_type}` | {row.note} | — | refused |")
            continue
        arch = model.trainer_architecture
        features = "; ".join(arch.features()) or "full attention"
        if row.note:
            features = f"{features} ({row.note})"
        lines.append(f"| {row.family} | `{arch.model_type}` | {features} | {arch.path()} | exact |")
    return "\n".join(lines)


def current(readme: str) -> str:
    start, end = readme.index(BEGIN) + len(BEGIN), readme.index(END)
    return readme[start:end].strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help="rewrite README.md's table")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        text = table(Path(tmp))
    if not args.write:
        print(text)
        return 0
    readme = README.read_text()
    start, end = readme.index(BEGIN) + len(BEGIN), readme.index(END)
    README.write_text(readme[:start] + "\n" + text + "\n" + readme[end:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
