"""Run tinker-cookbook 0.6.1's own SDFT recipe (`recipes/sdft/train.py`), unchanged.

Executed by the tinker venv's python (see `tests/tinker/venv.py`), with `TINKER_BASE_URL` and
`TINKER_API_KEY` set to the worker. Only the outside world the recipe would download is
replaced, before its `cli_main` runs:

- the tokenizer: registered under the model's name through the cookbook's own hook
  (`tokenizer_utils.register_tokenizer`), loading the offline tokenizer directory;
- the dataset: the recipe's `load_dataset("hicai-zju/SciKnowEval")` returns synthetic rows in
  SciKnowEval's shape (Chemistry, L3, multiple choice), all alike.

Everything else is the recipe's defaults unless given (`lora_rank` 128, `topk` 20, forward
mode; `reverse=true` for the reverse-KL custom loss), with the sampling and the top-K prompt
logprobs of the teacher served by the worker.

Usage: python sdft_runner.py TOKENIZER_DIR MODEL_NAME LOG_PATH [key=value ...]
(the key=values are the recipe's `CLIConfig` fields, parsed as JSON where they parse).
Prints one JSON line: the recipe's logged metrics and its checkpoint records.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from tests.tinker.cookbook_runner import parse_value, read_jsonl


def sciknoweval_rows(n: int) -> list[dict[str, Any]]:
    return [
        {
            "question": "what is two plus three ?",
            "choices": {"label": ["A", "B"], "text": ["five", "four"]},
            "answerKey": "A",
            "domain": "Chemistry",
            "details": {"level": "L3"},
            "type": "mcq-2-choices",
        }
        for _ in range(n)
    ]


def main(argv: list[str]) -> None:
    tokenizer_dir, model_name, log_path, *overrides = argv
    from tinker_cookbook import tokenizer_utils
    from tinker_cookbook.recipes.sdft import datasets as sdft_datasets
    from tinker_cookbook.recipes.sdft import train as recipe
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer_utils.register_tokenizer(model_name, lambda: tokenizer)
    rows = sciknoweval_rows(20)

    def load_dataset(*args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        return rows

    sdft_datasets.load_dataset = load_dataset  # the only thing the recipe would download

    fields = dict(item.split("=", 1) for item in overrides)
    config = recipe.CLIConfig(
        model_name=model_name,
        log_path=log_path,
        **{k: parse_value(v) for k, v in fields.items()},
    )
    asyncio.run(recipe.cli_main(config))

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
