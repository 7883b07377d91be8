"""`prompt_truncate_len` on the chat route (docs/semantics.md §25a): a conversation rendered
longer than that loses its earliest user turns, the system message kept, until it fits. The
reference is the test's own: the model's template applied by hand to each candidate cut, the
first (longest) that fits being the one the worker must have sent."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from tests.api.conftest import LiveServer
from tests.fireworks import test_completions as completions
from tests.fireworks.conftest import bpe_chat_model, client_script, run_inline, serve_for_alice

pytestmark = pytest.mark.fireworks

MODEL = "accounts/fireworks/models/bpe-qwen3-chat"
ROUTE = "/inference/v1/chat/completions"
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "answer yes or no"},
    {"role": "user", "content": "hello world, maybe so"},
    {"role": "assistant", "content": "maybe not"},
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "no"},
    {"role": "tool", "content": "yes"},
    {"role": "user", "content": "maybe so, maybe not?"},
    {"role": "assistant", "content": "yes"},
]
CUTS = (1, 3, 6)  # where a cut conversation may start after the system message
KEYS: dict[str, str] = {}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bpe_chat_model(tmp_path_factory.mktemp("truncate") / "qwen3", "qwen3", TEMPLATE, 7)


@pytest.fixture(scope="module")
def live(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with serve_for_alice({MODEL: model_dir}, tmp_path_factory, KEYS) as server:
        yield server


def chat(live: LiveServer, status: int = 200, **body: Any) -> dict[str, Any]:
    with completions.inference(live, "alice", KEYS) as http:
        response = http.post(ROUTE, json={"model": MODEL, "max_tokens": 2, **body})
    assert response.status_code == status, response.text
    out: dict[str, Any] = response.json()
    return out


def rendered(model_dir: Path, messages: list[dict[str, Any]]) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


def test_the_earliest_turns_go_until_the_prompt_fits(live: LiveServer, model_dir: Path) -> None:
    cuts = [CONVERSATION[:1] + CONVERSATION[start:] for start in CUTS]
    lengths = [len(rendered(model_dir, cut)) for cut in cuts]
    assert lengths == sorted(lengths, reverse=True) and len(set(lengths)) == len(lengths)
    # each limit from the whole prompt's length down to the last turn's
    limits = [*lengths, *(n - 1 for n in lengths[:-1]), lengths[-1] + 1]
    for limit in sorted(set(limits), reverse=True):
        want = next(cut for cut, n in zip(cuts, lengths, strict=True) if n <= limit)
        out = chat(live, messages=CONVERSATION, prompt_truncate_len=limit, return_token_ids=True)
        assert out["prompt_token_ids"] == rendered(model_dir, want), limit
        assert out["usage"]["prompt_tokens"] == len(out["prompt_token_ids"]) <= limit
    whole = chat(live, messages=CONVERSATION, return_token_ids=True)
    assert whole["prompt_token_ids"] == rendered(model_dir, CONVERSATION)


@pytest.mark.parametrize("limit", [0, -3, 2.5, True, "64", "last-turn-minus-one"])
def test_a_limit_that_cannot_be_met_is_a_400_naming_it(
    live: LiveServer, model_dir: Path, limit: Any
) -> None:
    if limit == "last-turn-minus-one":
        limit = len(rendered(model_dir, CONVERSATION[:1] + CONVERSATION[CUTS[-1] :])) - 1
    error = chat(live, 400, messages=CONVERSATION, prompt_truncate_len=limit)["error"]
    assert error["param"] == "prompt_truncate_len", error


def test_the_sdk_sends_the_limit(live: LiveServer, model_dir: Path, fw_python_latest: Path) -> None:
    limit = len(rendered(model_dir, CONVERSATION[:1] + CONVERSATION[CUTS[-1] :]))
    script = client_script(
        "model, messages, limit",
        "r = client.chat.completions.create(model=model, messages=json.loads(messages),"
        " max_tokens=2, prompt_truncate_len=int(limit))\n"
        "print(json.dumps(r.usage.prompt_tokens))\n",
    )
    argv = [live.url, KEYS["alice"], MODEL, json.dumps(CONVERSATION), str(limit)]
    assert run_inline(fw_python_latest, script, argv) == limit
