"""Run tinker-cookbook 0.6.1's own `recipes/sl_loop.py` or `recipes/rl_loop.py`, unchanged.

Executed by the tinker venv's python (see `tests/tinker/venv.py`), with `TINKER_BASE_URL` and
`TINKER_API_KEY` set to the worker. Only the outside world the recipes would download is
replaced, before the recipe's `main` runs:

- the tokenizer: registered under the model's name through the cookbook's own hook
  (`tokenizer_utils.register_tokenizer`), loading the offline tokenizer directory;
- the dataset: `datasets.load_dataset` returns a small synthetic `DatasetDict` shaped like
  `HuggingFaceH4/no_robots` (SL: `messages`) or `openai/gsm8k` (RL: `question`, `answer`).

Usage: python cookbook_runner.py {sl,rl} TOKENIZER_DIR MODEL_NAME LOG_PATH [key=value ...]
(the key=values are the recipe's `Config` fields, parsed as JSON where they parse).
Prints one JSON line: the recipe's logged metrics and its checkpoint records.
"""

from __future__ import annotations

import json
import sys
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


def parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main(argv: list[str]) -> None:
    kind, tokenizer_dir, model_name, log_path, *overrides = argv
    import datasets
    from tinker_cookbook import tokenizer_utils
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer_utils.register_tokenizer(model_name, lambda: tokenizer)

    rows = sl_rows(32) if kind == "sl" else rl_rows(32)
    synthetic = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)})

    def load_dataset(*args: Any, **kwargs: Any) -> datasets.DatasetDict:
        return synthetic

    datasets.load_dataset = load_dataset  # the only thing the recipes would download

    if kind == "sl":
        from tinker_cookbook.recipes import sl_loop as recipe
    elif kind == "rl":
        from tinker_cookbook.recipes import rl_loop as recipe  # type: ignore[no-redef]
    else:
        raise SystemExit(f"unknown recipe {kind!r}")
    fields = dict(item.split("=", 1) for item in overrides)
    config = recipe.Config(
        model_name=model_name,
        log_path=log_path,
        **{k: parse_value(v) for k, v in fields.items()},
    )
    recipe.main(config)

    out = Path(log_path)
    print(
        json.dumps(
            {
                "metrics": read_jsonl(out / "metrics.jsonl"),
                "checkpoints": read_jsonl(out / "checkpoints.jsonl"),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
