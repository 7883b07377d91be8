"""Run one of tinker-cookbook 0.6.1's own programs, unchanged, against the worker.

Executed by the tinker venv's python (see `tests/tinker/venv.py`), with `TINKER_BASE_URL` and
`TINKER_API_KEY` set to the worker. Only the outside world the recipes would download is
replaced, before the recipe is imported:

- the tokenizer: registered under every served model's name through the cookbook's own hook
  (`tokenizer_utils.register_tokenizer`), loading the offline tokenizer directory (all the
  served models share its vocabulary);
- the datasets: `datasets.load_dataset` returns small synthetic ones shaped like those the
  recipes name (`SYNTHETIC`); any other name fails, so a recipe cannot download unnoticed.

Usage: python cookbook_runner.py RECIPE TOKENIZER_DIR MODEL_NAMES LOG_PATH [key=value ...]

- RECIPE `sl` or `rl`: `recipes/sl_loop.py` / `recipes/rl_loop.py`, their `Config` built from
  the key=values (parsed as JSON where they parse) with `model_name` the first of MODEL_NAMES
  (comma-separated) and `log_path` LOG_PATH, then their `main`;
- any other RECIPE is a module run as its `__main__`, as `python -m RECIPE key=value ...`
  would (the key=values are its own `chz` command line), with `TINKER_COOKBOOK_RUNS_DIR` set to
  LOG_PATH for the recipes that write under the runs directory.

Prints one JSON line: every `metrics.jsonl` and `checkpoints.jsonl` under LOG_PATH, by the
folder that holds it relative to LOG_PATH ("." for LOG_PATH itself).
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def sl_rows(n: int) -> list[dict[str, Any]]:
    """Conversations in no_robots' shape, all alike, so every batch measures the same thing."""
    rows = []
    for i in range(n):
        question, answer = "what is two plus three ?", "the answer is five ."
        messages = [
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ]
        rows.append({"messages": messages, "prompt": question, "prompt_id": str(i)})
    return rows


def rl_rows(n: int) -> list[dict[str, Any]]:
    """Problems in gsm8k's shape; every answer is 0, which `\\boxed{0}` gets right."""
    return [
        {"question": f"what is {i % 3} plus 0 ?", "answer": "0 plus 0 is 0\n#### 0"}
        for i in range(n)
    ]


def hh_rows(n: int) -> list[dict[str, Any]]:
    """Comparisons in Anthropic/hh-rlhf's shape: the same prompt, a right and a wrong answer."""
    prompt = "\n\nHuman: what is two plus three ?"
    return [
        {
            "chosen": f"{prompt}\n\nAssistant: the answer is five .",
            "rejected": f"{prompt}\n\nAssistant: the cat sat on a mat .",
        }
        for _ in range(n)
    ]


def question_rows(n: int) -> list[dict[str, Any]]:
    """Prompts in DeepMath-103K's shape (`question`), all alike, so every batch measures the
    same thing."""
    return [{"question": "what is two plus three ?"} for _ in range(n)]


# dataset name -> split -> rows
SYNTHETIC: dict[str, Callable[[], dict[str, list[dict[str, Any]]]]] = {
    "HuggingFaceH4/no_robots": lambda: {"train": sl_rows(32), "test": sl_rows(4)},
    "openai/gsm8k": lambda: {"train": rl_rows(32), "test": rl_rows(4)},
    "Anthropic/hh-rlhf": lambda: {"train": hh_rows(32), "test": hh_rows(4)},
    "zwhe99/DeepMath-103K": lambda: {"train": question_rows(32)},
}


def load_dataset(path: str, *args: Any, split: str | None = None, **kwargs: Any) -> Any:
    """`datasets.load_dataset` for the names of `SYNTHETIC` (a `DatasetDict`, or one split)."""
    import datasets

    if path not in SYNTHETIC:
        raise RuntimeError(f"cookbook_runner: no synthetic data set for {path!r}")
    splits = {k: datasets.Dataset.from_list(rows) for k, rows in SYNTHETIC[path]().items()}
    if split is None:
        return datasets.DatasetDict(splits)
    if split not in splits:
        raise ValueError(f"Unknown split {split!r} of {path}; have {sorted(splits)}")
    return splits[split]


def parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def logs_under(root: Path) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """{folder relative to `root`: {"metrics": [...], "checkpoints": [...]}}."""
    folders = {p.parent for name in ("metrics", "checkpoints") for p in root.rglob(f"{name}.jsonl")}
    return {
        str(folder.relative_to(root)): {
            "metrics": read_jsonl(folder / "metrics.jsonl"),
            "checkpoints": read_jsonl(folder / "checkpoints.jsonl"),
        }
        for folder in sorted(folders)
    }


def run_loop(kind: str, model_name: str, log_path: str, overrides: list[str]) -> None:
    if kind == "sl":
        from tinker_cookbook.recipes import sl_loop as recipe
    else:
        from tinker_cookbook.recipes import rl_loop as recipe  # type: ignore[no-redef]
    fields = dict(item.split("=", 1) for item in overrides)
    config = recipe.Config(
        model_name=model_name,
        log_path=log_path,
        **{k: parse_value(v) for k, v in fields.items()},
    )
    recipe.main(config)


def main(argv: list[str]) -> None:
    recipe, tokenizer_dir, model_names, log_path, *overrides = argv
    import datasets
    from tinker_cookbook import tokenizer_utils
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    names = model_names.split(",")
    for name in names:
        tokenizer_utils.register_tokenizer(name, lambda: tokenizer)
    datasets.load_dataset = load_dataset  # the only thing the recipes would download

    if recipe in ("sl", "rl"):
        run_loop(recipe, names[0], log_path, overrides)
    else:
        os.environ["TINKER_COOKBOOK_RUNS_DIR"] = log_path
        sys.argv = [recipe, *overrides]
        runpy.run_module(recipe, run_name="__main__", alter_sys=True)
    print(json.dumps({"logs": logs_under(Path(log_path))}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
