"""Thinking blocks split off a chat reply into `reasoning_content` (docs/semantics.md §25a), on
catalogue models with a byte-level BPE tokenizer: a tied Qwen3 whose template lets the reply
open its own `<think>` block (Qwen3's way), and an untied Llama whose generation prompt opens
the block (DeepSeek-R1's and Qwen3.5's way). The replies are held to a few known shapes by a
`response_format` grammar, so each split is checked against the test's own reading of the
completion's token ids, streamed or not, through the Fireworks SDK, and written back by the
template as the very same text."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from tests.api.conftest import LiveServer
from tests.fireworks import test_completions as completions
from tests.fireworks.conftest import bpe_chat_model, client_script, run_inline, serve_for_alice

pytestmark = pytest.mark.fireworks

OWN = "accounts/fireworks/models/bpe-qwen3-thinks"  # the reply opens its block
OPENED = "accounts/fireworks/models/bpe-llama-opened"  # the prompt opens it
TAGGED = "accounts/fireworks/models/bpe-llama-opened-tags"  # and `</think>` is one token
DROPPED = "accounts/fireworks/models/bpe-llama-dropped-tags"  # special: decoding drops them
ROUTE = "/inference/v1/chat/completions"
TURNS = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content is defined and m.reasoning_content %}"
    "<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
)
TEMPLATES = {
    OWN: TURNS + "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}",
    OPENED: TURNS + "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}",
}
THOUGHTS = '("hm" | "so so, maybe\\nnot")'
ANSWERS = '("yes" | "no, not so")'
GRAMMARS = {
    OWN: f'root ::= "<think>\\n" {THOUGHTS} "\\n</think>\\n\\n" {ANSWERS} | {ANSWERS}',
    OPENED: f'root ::= {THOUGHTS} "\\n</think>\\n\\n" {ANSWERS}',
}
ASK = [{"role": "user", "content": "hello world"}]
KEYS: dict[str, str] = {}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("think-models")
    out: dict[str, Path] = {}
    for name, arch in ((OWN, "qwen3"), (OPENED, "llama")):
        out[name] = bpe_chat_model(root / arch, arch, TEMPLATES[name], seed=6)
    # the prompt opens the block, the tokenizer holds `<think>` and `</think>` as Qwen3's does
    added = ("<think>", "</think>")
    out[TAGGED] = bpe_chat_model(root / "tagged", "llama", TEMPLATES[OPENED], 8, added)
    out[DROPPED] = bpe_chat_model(root / "dropped", "llama", TEMPLATES[OPENED], 8, added, True)
    return out


@pytest.fixture(scope="module")
def live(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with serve_for_alice(models, tmp_path_factory, KEYS) as server:
        yield server


def chat(live: LiveServer, **body: Any) -> dict[str, Any]:
    with completions.inference(live, "alice", KEYS) as http:
        response = http.post(ROUTE, json=body)
    assert response.status_code == 200, response.text
    out: dict[str, Any] = response.json()
    return out


def reference(model: str, text: str) -> tuple[str | None, str]:
    """The test's own reading: (the reasoning, the answer) of a whole reply."""
    if model == OPENED:
        text = "<think>\n" + text
    found = re.fullmatch(r"<think>\n(.*?)\n</think>\n\n(.*)", text, flags=re.DOTALL)
    if found is None:
        return None, text
    return found.group(1), found.group(2)


def body(model: str, **extra: Any) -> dict[str, Any]:
    out = {"model": model, "messages": ASK, "n": 8, "max_tokens": 40, "seed": 3}
    out |= {"temperature": 1.0, "return_token_ids": True}
    out["response_format"] = {"type": "grammar", "grammar": GRAMMARS[model]}
    return out | extra


@pytest.mark.parametrize("model", [OWN, OPENED])
def test_the_thinking_is_the_reasoning_and_the_rest_the_content(
    live: LiveServer, models: dict[str, Path], model: str
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(models[model])
    seen = set()
    for choice in chat(live, **body(model))["choices"]:
        assert choice["finish_reason"] == "stop", choice
        text = tokenizer.decode([t for t in choice["token_ids"] if t != 1])
        reasoning, content = reference(model, text)
        message = choice["message"]
        assert message.get("reasoning_content") == reasoning and message["content"] == content
        assert ("reasoning_content" in message) is (reasoning is not None)
        seen.add(reasoning is None)
        # the template writes the answer back as the very reply
        turn = {"role": "assistant", "content": content, "reasoning_content": reasoning}
        written = tokenizer.apply_chat_template([*ASK, turn], tokenize=False)
        whole = f"<think>\n{reasoning}\n</think>\n\n{content}" if reasoning else content
        assert written.endswith(f"<|im_start|>assistant\n{whole}<|im_end|>\n"), written
    assert seen == ({True, False} if model == OWN else {False})


@pytest.mark.parametrize("model", [OWN, OPENED])
def test_a_reply_cut_while_thinking_is_all_reasoning(live: LiveServer, model: str) -> None:
    thought = "so so, maybe not, " * 4
    opening = '"<think>\\n" ' if model == OWN else ""
    grammar = f'root ::= {opening}"{thought}" "\\n</think>\\n\\nyes"'
    constraint = {"type": "grammar", "grammar": grammar}
    out = chat(live, **body(model, n=1, max_tokens=16, response_format=constraint))
    (choice,) = out["choices"]
    assert choice["finish_reason"] == "length"
    message = choice["message"]
    assert message["content"] == "" and message["reasoning_content"]
    assert thought.startswith(message["reasoning_content"]), message


@pytest.mark.parametrize("model", [OWN, OPENED])
def test_streamed_deltas_add_up_to_the_whole_message(live: LiveServer, model: str) -> None:
    for seed in range(4):
        asked = body(model, n=1, seed=seed)
        whole = chat(live, **asked)["choices"][0]["message"]
        with completions.inference(live, "alice", KEYS) as http:
            response = http.post(ROUTE, json={**asked, "stream": True})
        assert response.status_code == 200, response.text
        message, finish, _ = completions.chat_message(response)
        assert finish == "stop"
        assert message == whole


def test_the_sdk_reads_the_reasoning_apart(live: LiveServer, fw_python_latest: Path) -> None:
    script = client_script(
        "model, messages, grammar",
        "r = client.chat.completions.create(model=model, messages=json.loads(messages),"
        " max_tokens=40, seed=5, n=4, response_format={'type': 'grammar', 'grammar': grammar})\n"
        "print(json.dumps([[c.message.reasoning_content, c.message.content]"
        " for c in r.choices]))\n",
    )
    argv = [live.url, KEYS["alice"], OPENED, json.dumps(ASK), GRAMMARS[OPENED]]
    answers = run_inline(fw_python_latest, script, argv)
    for reasoning, content in answers:
        assert reasoning in ("hm", "so so, maybe\nnot") and content in ("yes", "no, not so")


SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("thinking", "text", "accepted"),
    [
        ("optional", '<think>\nhm, {"answer" </thin\n</think>\n\n{"answer": "no"}', True),
        ("optional", '{"answer": "yes"}', True),
        ("optional", "<think>\nhm\n</think>\n\nyes", False),  # the answer must be the JSON
        ("optional", '<think>\nhm\n</think>{"answer": "no"}', False),  # as the template writes
        ("open", 'hm\n</think>\n\n{"answer": "yes"}', True),
        ("open", '{"answer": "yes"}', False),  # the open block must close first
    ],
)
def test_a_json_answer_may_follow_the_thinking(
    models: dict[str, Path], thinking: Any, text: str, accepted: bool
) -> None:
    import llguidance
    import llguidance.hf

    from trainer.api.fireworks.chat_think import Thought, thinking_first
    from trainer.contract.grammar import OutputGrammar

    grammar = thinking_first(OutputGrammar("json_schema", json.dumps(SCHEMA)), Thought(thinking))
    tokenizer = AutoTokenizer.from_pretrained(models[OWN])
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=[1])
    matcher = llguidance.LLMatcher(lltok, grammar.text)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert (all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()) is accepted


def test_response_format_holds_the_content_after_the_thinking(live: LiveServer) -> None:
    """On a template that thinks, the grammar is the answer's: a reply may think first, and its
    content is JSON that fits (checked by hand); a reply cut while thinking has no content."""
    asked = {"model": OWN, "messages": ASK, "n": 8, "max_tokens": 40, "seed": 4}
    asked |= {"temperature": 1.0, "response_format": {"type": "json_object", "schema": SCHEMA}}
    choices = chat(live, **asked)["choices"]
    finished = [c for c in choices if c["finish_reason"] == "stop"]
    assert finished, choices
    for choice in finished:
        assert json.loads(choice["message"]["content"])["answer"] in ("yes", "no"), choice
    for choice in choices:  # a cut reply: no content yet, or the start of the JSON
        content = choice["message"]["content"].lstrip()
        assert content == "" or content.startswith("{"), choice


def test_a_bad_grammar_on_a_thinking_model_is_a_400(live: LiveServer) -> None:
    with completions.inference(live, "alice", KEYS) as http:
        body = {"model": OWN, "messages": ASK, "response_format": {"type": "grammar"}}
        body["response_format"]["grammar"] = "root ::= ("
        response = http.post(ROUTE, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "response_format"


@pytest.mark.parametrize("budget", [1, 3, 6])
def test_a_thinking_budget_ends_the_thought_at_its_end_token(
    live: LiveServer, models: dict[str, Path], budget: int
) -> None:
    """`reasoning_effort` an integer: the thought is at most that many tokens, then the
    `</think>` token (forced when the thought reaches the budget); the answer is free."""
    tokenizer = AutoTokenizer.from_pretrained(models[TAGGED])
    end = tokenizer.convert_tokens_to_ids("</think>")
    asked = {"model": TAGGED, "messages": ASK, "n": 6, "max_tokens": 12, "seed": budget}
    asked |= {"temperature": 1.0, "reasoning_effort": budget, "return_token_ids": True}
    for choice in chat(live, **asked)["choices"]:
        ids = choice["token_ids"]
        assert end in ids[: budget + 1], ids  # the thought is the ids before it
        thought = ids[: ids.index(end)]
        assert len(thought) <= budget
        message = choice["message"]
        reasoning = tokenizer.decode(thought).strip("\n") or None
        assert message.get("reasoning_content") == reasoning, (message, ids)


def test_a_budget_with_json_thinks_then_answers(live: LiveServer, models: dict[str, Path]) -> None:
    asked = {"model": TAGGED, "messages": ASK, "n": 4, "max_tokens": 40, "seed": 5}
    asked |= {"temperature": 1.0, "reasoning_effort": 3}
    asked["response_format"] = {"type": "json_object", "schema": SCHEMA}
    choices = chat(live, **asked)["choices"]
    finished = [c for c in choices if c["finish_reason"] == "stop"]
    assert finished, choices
    for choice in finished:
        assert json.loads(choice["message"]["content"])["answer"] in ("yes", "no"), choice


@pytest.mark.parametrize(
    ("model", "asked", "param"),
    [
        (OPENED, {"reasoning_effort": 64}, "reasoning_effort"),  # `</think>` is no token
        (TAGGED, {"reasoning_effort": 0}, "reasoning_effort"),
        (TAGGED, {"thinking": {"type": "enabled", "budget_tokens": 512}}, "thinking.budget_tokens"),
        (TAGGED, {"thinking": {"type": "enabled", "budget": 2048}}, "thinking"),
    ],
)
def test_a_budget_that_cannot_be_served_is_a_400_naming_it(
    live: LiveServer, model: str, asked: dict[str, Any], param: str
) -> None:
    with completions.inference(live, "alice", KEYS) as http:
        response = http.post(ROUTE, json={"model": model, "messages": ASK, **asked})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_budget_tokens_are_served_as_the_sdk_sends_them(live: LiveServer) -> None:
    thinking = {"type": "enabled", "budget_tokens": 1024}
    out = chat(live, model=TAGGED, messages=ASK, max_tokens=4, thinking=thinking)
    assert out["choices"][0]["finish_reason"] == "length"


def test_a_tokenizer_that_drops_the_tags_does_not_think(live: LiveServer) -> None:
    """Its replies hold no block to find: all content, the grammar the whole reply's, and no
    budget."""
    asked = {"model": DROPPED, "messages": ASK, "n": 4, "max_tokens": 6, "seed": 2}
    asked["response_format"] = {"type": "grammar", "grammar": 'root ::= "yes" | "no"'}
    for choice in chat(live, **asked)["choices"]:
        assert choice["message"] == {"role": "assistant", "content": choice["message"]["content"]}
        assert choice["message"]["content"] in ("yes", "no")
    with completions.inference(live, "alice", KEYS) as http:
        body = {"model": DROPPED, "messages": ASK, "reasoning_effort": 8}
        response = http.post(ROUTE, json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "reasoning_effort"
