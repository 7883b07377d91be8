"""Replies in channels (harmony, GPT-OSS's format) on `POST /inference/v1/chat/completions`
(docs/semantics.md §25a): a tiny model whose tokenizer has harmony's structural tokens as
special tokens and whose template writes channels, its LoRA adapter trained through the Tinker
routes to reason in `analysis` and answer in `final`. Its greedy reply comes back split:
`reasoning_content` and `content`, each the text of its channel's tokens as the test reads
them from the completion's token ids; and `reasoning_effort` reaches its template."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer, GenerationConfig

from tests.api.conftest import LiveServer, serve_in_thread
from tests.api.team_helpers import write_keys
from tests.fireworks import test_completions as completions
from tests.tinker import tinker_http as th
from tests.tinker.conftest import VOCAB, build_served_model
from trainer.api.keys import KeyRing

pytestmark = pytest.mark.fireworks

MODEL = "accounts/fireworks/models/harmony-tiny"
ROUTE = "/inference/v1/chat/completions"
MARKS = ("<|channel|>", "<|message|>", "<|start|>", "<|end|>", "<|return|>", "<|call|>")
EXTRA = (*MARKS, "analysis", "final")
CH, MSG, START, END, RETURN, _CALL, ANALYSIS, FINAL = range(len(VOCAB), len(VOCAB) + len(EXTRA))
TEMPLATE = (
    "{% if reasoning_effort is defined %}<|start|>system<|message|>{{ reasoning_effort }}"
    "<|end|>{% endif %}{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "<|start|>assistant<|channel|>final<|message|>{{ m['content'] }}<|end|>{% else %}"
    "<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
ASK = [{"role": "user", "content": "what is two plus three ?"}]
WRITTEN = "<|start|>user<|message|>what is two plus three ?<|end|><|start|>assistant"
WORD = {w: VOCAB.index(w) for w in ("two", "plus", "three", "five", "assistant")}
REPLY = [
    *(CH, ANALYSIS, MSG, WORD["two"], WORD["plus"], WORD["three"], END),
    *(START, WORD["assistant"], CH, FINAL, MSG, WORD["five"], RETURN),
]
KEYS: dict[str, str] = {}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Harmony's structural tokens special (decoding skips them, as GPT-OSS's tokenizer
    does), and `<|return|>` an end of sequence, as in GPT-OSS's generation config."""
    where = tmp_path_factory.mktemp("harmony")
    build_served_model(where, 8.0, 5, where, positions=96, extra=EXTRA)
    tokenizer = AutoTokenizer.from_pretrained(where)
    tokenizer.add_special_tokens({"additional_special_tokens": list(MARKS)})
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(where)
    GenerationConfig(eos_token_id=[1, RETURN], pad_token_id=0).save_pretrained(where)
    return where


@pytest.fixture(scope="module")
def live(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    KEYS.update(write_keys(path, (), ("alice",)))
    storage = tmp_path_factory.mktemp("harmony-storage")
    with serve_in_thread(storage, {MODEL: model_dir}, keys=KeyRing(path)) as server:
        yield server


def ids(model_dir: Path, text: str) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


@pytest.fixture(scope="module")
def reasoner(live: LiveServer, model_dir: Path) -> str:
    """A sampler checkpoint that reasons "two plus three", then answers "five"."""
    data = [th.datum(ids(model_dir, WRITTEN) + REPLY)]
    return completions.overfit_checkpoint(live, KEYS, MODEL, data, "r")


def chat(live: LiveServer, status: int = 200, **body: Any) -> dict[str, Any]:
    return completions.greedy_chat(live, KEYS, status, {"max_tokens": 24, **body})


def test_a_reply_in_channels_is_split(live: LiveServer, model_dir: Path, reasoner: str) -> None:
    out = chat(live, model=reasoner, messages=ASK, return_token_ids=True)
    assert out["prompt_token_ids"] == ids(model_dir, WRITTEN)
    (choice,) = out["choices"]
    assert choice["token_ids"] == REPLY, choice  # the model's own reply, to its end
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # the test's reading: each channel's text is the decoding of the tokens of its message
    analysis = tokenizer.decode(REPLY[3:6], skip_special_tokens=True)
    final = tokenizer.decode(REPLY[12:13], skip_special_tokens=True)
    assert (analysis, final) == ("two plus three", "five")
    message = choice["message"]
    assert message == {"role": "assistant", "content": final, "reasoning_content": analysis}
    assert choice["finish_reason"] == "stop"
    # decoded whole with its special tokens skipped, the reply would run the two together
    assert tokenizer.decode(REPLY, skip_special_tokens=True) != final


def test_a_reply_cut_short_keeps_what_it_reasoned(live: LiveServer, reasoner: str) -> None:
    out = chat(live, model=reasoner, messages=ASK, max_tokens=5)
    (choice,) = out["choices"]
    assert choice["message"]["reasoning_content"] == "two plus"
    assert choice["message"]["content"] is None and choice["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("asked", "effort"),
    [
        ({"reasoning_effort": "high"}, "high"),
        ({"reasoning_effort": True}, "medium"),  # as the Fireworks SDK documents `true`
        ({"thinking": {"type": "enabled"}}, "medium"),
    ],
)
def test_reasoning_effort_reaches_the_template(
    live: LiveServer, model_dir: Path, asked: dict[str, Any], effort: str
) -> None:
    out = chat(live, model=MODEL, messages=ASK, return_token_ids=True, **asked)
    written = f"<|start|>system<|message|>{effort}<|end|>" + WRITTEN
    assert out["prompt_token_ids"] == ids(model_dir, written)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"reasoning_effort": "none"}, "reasoning_effort"),  # no enable_thinking switch
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ],
    ids=["none", "unknown-effort", "tools"],
)
def test_what_a_harmony_chat_cannot_do_is_a_400(
    live: LiveServer, body: dict[str, Any], param: str
) -> None:
    error = chat(live, 400, model=MODEL, messages=ASK, **body)["error"]
    assert error["param"] == param, error


@pytest.mark.parametrize("max_tokens", [24, 5])
def test_a_streamed_reply_adds_up_to_the_whole_answer(
    live: LiveServer, reasoner: str, max_tokens: int
) -> None:
    """Reasoning and content deltas as each channel grows: together, the whole answer's
    message (whole, and cut short inside the reasoning)."""
    body = {"model": reasoner, "messages": ASK, "max_tokens": max_tokens}
    whole = chat(live, **body)["choices"][0]
    with completions.inference(live, "alice", KEYS) as http:
        response = http.post(ROUTE, json={"temperature": 0, **body, "stream": True})
    assert response.status_code == 200, response.text
    message, finish, chunks = completions.chat_message(response)
    want = {k: v for k, v in whole["message"].items() if v is not None}
    assert message == want and finish == whole["finish_reason"], (message, whole)
    assert chunks > 2  # it streamed, not one chunk at the end


def test_a_message_cut_inside_its_header_counts_for_no_channel() -> None:
    """A reply cut after `<|channel|>` but before `<|message|>`: the message's channel is not
    known, so it is in neither part (a stream would otherwise send a newline the whole answer
    does not have)."""
    from trainer.api.fireworks.chat_harmony import Harmony

    words = {100: "commentary", 101: "hello", 102: "analysis", 103: "assistant"}
    harmony = Harmony(channel=1, message=2, start=3, ends=frozenset({4, 5, 6}))

    def text(ids: list[int]) -> str:
        return " ".join(words[i] for i in ids if i in words)

    reply = [1, 100, 2, 101, 4, 3, 103, 1]
    got = harmony.split(reply, text)
    assert got is not None and (got.reasoning, got.content) == (None, "hello")
    whole = harmony.split([*reply, 102, 2, 101, 4], text)
    assert whole is not None and (whole.reasoning, whole.content) == ("hello", "hello")
