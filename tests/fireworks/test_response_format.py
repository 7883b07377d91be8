"""`response_format` on the completion routes (docs/semantics.md §17.2), on catalogue models
with a byte-level BPE tokenizer (a tied Qwen3, an untied Llama): every finished answer is a
sentence of the grammar, or JSON that fits the schema (checked here by hand), streamed or not,
and through the Fireworks SDK; what cannot be served is a 400 naming the field. The draws
themselves are held to a reference in `tests/engine/test_grammar.py`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.api.conftest import LiveServer
from tests.engine.test_grammar import GBNF, LANGUAGE
from tests.fireworks import test_completions as completions
from tests.fireworks.conftest import bpe_chat_model, client_script, run_inline, serve_for_alice
from tests.tinker.conftest import build_served_model

pytestmark = pytest.mark.fireworks

QWEN = "accounts/fireworks/models/bpe-qwen3"
LLAMA = "accounts/fireworks/models/bpe-llama"
WORDS = "accounts/fireworks/models/word-level"
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "hello world"}]
KEYS: dict[str, str] = {}


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("bpe-models")
    models: dict[str, Path] = {}
    for name, arch in ((QWEN, "qwen3"), (LLAMA, "llama")):
        models[name] = bpe_chat_model(root / arch, arch, TEMPLATE, seed=3)
    models[WORDS] = build_served_model(root / "words", 8.0, 0, root / "words")
    with serve_for_alice(models, tmp_path_factory, KEYS) as server:
        yield server


def post(live: LiveServer, route: str, status: int = 200, **body: Any) -> dict[str, Any]:
    with completions.inference(live, "alice", KEYS) as http:
        response = http.post(route, json=body)
    assert response.status_code == status, response.text
    out: dict[str, Any] = response.json()
    return out


def _fits(text: str) -> bool:
    value = json.loads(text)
    return set(value) == {"answer"} and value["answer"] in ("yes", "no")


@pytest.mark.parametrize("model", [QWEN, LLAMA])
def test_completions_say_a_sentence_of_the_grammar(live: LiveServer, model: str) -> None:
    body = {"model": model, "prompt": "hello world", "n": 8, "max_tokens": 12, "seed": 1}
    body["response_format"] = {"type": "grammar", "grammar": GBNF}
    out = post(live, "/inference/v1/completions", **body, temperature=1.0)
    texts = [c["text"] for c in out["choices"]]
    assert all(c["finish_reason"] == "stop" for c in out["choices"])
    assert set(texts) <= set(LANGUAGE) and len(set(texts)) > 1


@pytest.mark.parametrize("model", [QWEN, LLAMA])
@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "json_object", "schema": SCHEMA},
        {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}},
        {"type": "json_schema", "json_schema": json.dumps(SCHEMA)},
    ],
)
def test_chat_answers_json_that_fits_the_schema(
    live: LiveServer, model: str, response_format: dict[str, Any]
) -> None:
    body = {"model": model, "messages": ASK, "n": 4, "max_tokens": 40, "seed": 2}
    out = post(live, "/inference/v1/chat/completions", **body, response_format=response_format)
    finished = [c for c in out["choices"] if c["finish_reason"] == "stop"]
    assert finished and all(_fits(c["message"]["content"]) for c in finished)


def test_a_streamed_chat_adds_up_to_json_that_fits(live: LiveServer) -> None:
    body = {"model": QWEN, "messages": ASK, "max_tokens": 40, "seed": 3, "stream": True}
    body["response_format"] = {"type": "json_object", "schema": SCHEMA}
    with completions.inference(live, "alice", KEYS) as http:
        response = http.post("/inference/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    message, finish, _ = completions.chat_message(response)
    unstreamed = post(live, "/inference/v1/chat/completions", **{**body, "stream": False})
    assert message["content"] == unstreamed["choices"][0]["message"]["content"]
    if finish == "stop":
        assert _fits(message["content"])


def test_the_sdk_sends_a_json_schema_and_reads_json_back(
    live: LiveServer, fw_python_latest: Path
) -> None:
    sdk = client_script(
        "model, messages, schema",
        "r = client.chat.completions.create(model=model, messages=json.loads(messages),"
        " max_tokens=40, seed=4, n=3, response_format={'type': 'json_schema',"
        " 'json_schema': {'name': 'verdict', 'schema': json.loads(schema)}})\n"
        "print(json.dumps([[c.message.content, c.finish_reason] for c in r.choices]))\n",
    )
    argv = [live.url, KEYS["alice"], LLAMA, json.dumps(ASK), json.dumps(SCHEMA)]
    answers = run_inline(fw_python_latest, sdk, argv)
    finished = [content for content, finish in answers if finish == "stop"]
    assert finished and all(_fits(content) for content in finished)


@pytest.mark.parametrize(
    ("model", "response_format", "param"),
    [
        (QWEN, {"type": "xml"}, "response_format.type"),
        (QWEN, "json", "response_format"),
        (QWEN, {"type": "json_schema"}, "response_format.json_schema"),
        (QWEN, {"type": "json_schema", "json_schema": "{not json"}, "response_format.json_schema"),
        (QWEN, {"type": "json_object", "grammar": GBNF}, "response_format.grammar"),
        (QWEN, {"type": "grammar", "grammar": "root ::= ("}, "response_format"),
        (QWEN, {"type": "json_object", "schema": {"type": "frobnicate"}}, "response_format"),
        (WORDS, {"type": "json_object"}, "response_format"),
    ],
)
def test_what_cannot_be_served_is_a_400_naming_it(
    live: LiveServer, model: str, response_format: Any, param: str
) -> None:
    for route, prompt in (
        ("/inference/v1/completions", {"prompt": [5, 6, 7]}),
        ("/inference/v1/chat/completions", {"messages": ASK}),
    ):
        if model == WORDS and "chat" in route:
            continue  # that model has no chat template
        body = {"model": model, **prompt, "response_format": response_format}
        error = post(live, route, 400, **body)["error"]
        assert error["param"] == param, error


def test_text_is_no_constraint(live: LiveServer) -> None:
    body = {"model": QWEN, "prompt": [5, 6, 7], "max_tokens": 6, "seed": 5, "temperature": 1.0}
    plain = post(live, "/inference/v1/completions", **body)
    text = post(live, "/inference/v1/completions", **body, response_format={"type": "text"})
    assert text["choices"][0]["text"] == plain["choices"][0]["text"]
