"""`tool_choice` `required` and a named function on the chat route (docs/semantics.md §25a), on
catalogue models with a byte-level BPE tokenizer: a tied Qwen3 whose template writes Hermes
calls (with Qwen3's thinking switch), an untied Llama whose template writes Qwen3.5's XML
calls. Random weights at temperature 1, so every call comes from the grammar alone. The
references are the test's own: a regex-and-JSON reading of each completion's token ids, a
hand check of the arguments against the tool's schema, and the model's template, which must
write the answer's calls as exactly the completion's text."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llguidance
import llguidance.hf
import pytest
from transformers import AutoTokenizer

from tests.api.conftest import LiveServer
from tests.fireworks import test_completions as completions
from tests.fireworks.conftest import bpe_chat_model, client_script, run_inline, serve_for_alice
from trainer.api.fireworks.chat_think import Thought
from trainer.api.fireworks.chat_tools import HERMES, XML
from trainer.api.fireworks.tool_choice import Forced, calls_grammar

pytestmark = pytest.mark.fireworks

QWEN = "accounts/fireworks/models/bpe-qwen3-tools"
LLAMA = "accounts/fireworks/models/bpe-llama-xml-tools"
# Qwen3's tokenizer holds its tags as added tokens, which llguidance takes for special ones
TAGGED = "accounts/fireworks/models/bpe-qwen3-added-tags"
TAGS = ("<tool_call>", "</tool_call>", "<think>", "</think>")
ROUTE = "/inference/v1/chat/completions"
# Qwen3's way: a thinking switch, calls as `tojson` of {name, arguments}, one per line
HERMES_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}"
    "{% endif %}{% if m.tool_calls is defined %}{% for c in m.tool_calls %}"
    "{% if not loop.first %}{{ '\\n' }}{% endif %}<tool_call>\n"
    '{"name": {{ c.function.name | tojson }}, "arguments": {{ c.function.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
# Qwen3.5's way: one <parameter=...> block per argument
XML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}"
    "{% endif %}{% if m.tool_calls is defined %}{% for c in m.tool_calls %}"
    "{% if not loop.first %}{{ '\\n' }}{% endif %}<tool_call>\n<function={{ c.function.name }}>\n"
    "{% for k, v in c.function.arguments.items() %}<parameter={{ k }}>\n"
    "{% if v is mapping or (v is sequence and v is not string) %}{{ v | tojson }}"
    "{% else %}{{ v | string }}{% endif %}{{ '\\n' }}</parameter>\n"
    "{% endfor %}</function>\n</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 9},
        "b": {"type": "boolean"},
        "op": {"enum": ["plus", "minus"]},
        "c": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
FLIP = {
    "type": "object",
    "properties": {"on": {"type": "boolean"}},
    "required": ["on"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
    {"type": "function", "function": {"name": "flip", "parameters": FLIP}},
]
ASK = [{"role": "user", "content": "hello world"}]
KEYS: dict[str, str] = {}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tool-choice-models")
    out: dict[str, Path] = {}
    for name, arch, template in ((QWEN, "qwen3", HERMES_TEMPLATE), (LLAMA, "llama", XML_TEMPLATE)):
        out[name] = bpe_chat_model(root / arch, arch, template, seed=5)
    out[TAGGED] = bpe_chat_model(root / "tagged", "qwen3", HERMES_TEMPLATE, seed=5, added=TAGS)
    return out


@pytest.fixture(scope="module")
def live(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with serve_for_alice(models, tmp_path_factory, KEYS) as server:
        yield server


def chat(live: LiveServer, status: int = 200, **body: Any) -> dict[str, Any]:
    with completions.inference(live, "alice", KEYS) as http:
        response = http.post(ROUTE, json=body)
    assert response.status_code == status, response.text
    out: dict[str, Any] = response.json()
    return out


def _fits(arguments: dict[str, Any], schema: dict[str, Any]) -> bool:
    """The test's own check of the schemas above (integers in 0..9, booleans, the enum)."""
    properties = schema["properties"]
    if not set(schema["required"]) <= set(arguments) <= set(properties):
        return False
    for key, value in arguments.items():
        kind = properties[key].get("type")
        if kind == "integer" and not (type(value) is int and 0 <= value <= 9):
            return False
        if kind == "boolean" and type(value) is not bool:
            return False
        if kind == "array" and not all(type(v) is int and 0 <= v <= 9 for v in value):
            return False
        if "enum" in properties[key] and value not in properties[key]["enum"]:
            return False
    return True


def read_calls(text: str, form: str) -> list[tuple[str, dict[str, Any]]]:
    """The test's own reading of a completion made only of calls."""
    blocks = re.findall(r"<tool_call>\n(.*?)\n</tool_call>", text, flags=re.DOTALL)
    assert "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in blocks) == text, text
    if form == HERMES:
        return [(c["name"], c["arguments"]) for c in map(json.loads, blocks)]
    calls = []
    for block in blocks:
        (name, body), *_ = re.findall(r"^<function=(\w+)>\n(.*)</function>$", block, re.DOTALL)
        found = re.findall(r"<parameter=(\w+)>\n(.*?)\n</parameter>\n", body, flags=re.DOTALL)
        schema = ADD if name == "add" else FLIP
        typed = {}
        for key, value in found:
            kind = schema["properties"][key].get("type")
            if kind == "boolean":
                assert value in ("True", "False"), value  # Python's, as the template writes
                typed[key] = value == "True"
            else:
                typed[key] = value if kind is None else json.loads(value)
        calls.append((name, typed))
    return calls


def check_answer(
    models: dict[str, Path], model: str, choice: dict[str, Any], names: set[str]
) -> list[tuple[str, dict[str, Any]]]:
    """A finished choice's calls: read back by the test from the completion's ids, fitting
    their tools' schemas, written by the template as the completion's very text, and the
    answer's `tool_calls` the same."""
    tokenizer = AutoTokenizer.from_pretrained(models[model])
    assert choice["finish_reason"] == "tool_calls", choice
    ids = [t for t in choice["token_ids"] if t != 1]
    text = tokenizer.decode(ids)
    form = XML if model == LLAMA else HERMES
    calls = read_calls(text, form)
    assert calls and {name for name, _ in calls} <= names
    for name, arguments in calls:
        assert _fits(arguments, ADD if name == "add" else FLIP), (name, arguments)
    message = choice["message"]
    assert message["content"] is None
    answered = [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message["tool_calls"]
    ]
    assert answered == calls
    turn = {"role": "assistant", "content": None, "tool_calls": message["tool_calls"]}
    for call in turn["tool_calls"]:
        call["function"] = {
            **call["function"],
            "arguments": json.loads(call["function"]["arguments"]),
        }
    written = tokenizer.apply_chat_template([*ASK, turn], tokenize=False)
    assert written.endswith(f"<|im_start|>assistant\n{text}<|im_end|>\n"), (written, text)
    return calls


@pytest.mark.parametrize("model", [QWEN, LLAMA])
def test_a_required_call_is_a_call_of_an_offered_tool(
    live: LiveServer, models: dict[str, Path], model: str
) -> None:
    body = {"model": model, "messages": ASK, "tools": TOOLS, "tool_choice": "required"}
    body |= {"n": 8, "max_tokens": 200, "seed": 7, "temperature": 1.0, "return_token_ids": True}
    if model == QWEN:
        body["reasoning_effort"] = "none"
    out = chat(live, **body)
    finished = [c for c in out["choices"] if c["finish_reason"] != "length"]
    assert len(finished) >= 6, out
    for choice in finished:
        check_answer(models, model, choice, {"add", "flip"})


@pytest.mark.parametrize("model", [QWEN, LLAMA])
def test_a_named_call_is_one_call_of_that_tool(
    live: LiveServer, models: dict[str, Path], model: str
) -> None:
    named = {"type": "function", "function": {"name": "flip"}}
    body = {"model": model, "messages": ASK, "tools": TOOLS, "tool_choice": named}
    body |= {"n": 6, "max_tokens": 120, "seed": 8, "temperature": 1.0, "return_token_ids": True}
    if model == QWEN:
        body["reasoning_effort"] = "none"
    for choice in chat(live, **body)["choices"]:
        assert len(check_answer(models, model, choice, {"flip"})) == 1


@pytest.mark.parametrize("model", [QWEN, LLAMA])
def test_a_streamed_forced_call_adds_up_to_the_whole_answer(live: LiveServer, model: str) -> None:
    body = {"model": model, "messages": ASK, "tools": TOOLS, "tool_choice": "required"}
    body |= {"max_tokens": 200, "seed": 9, "temperature": 1.0}
    if model == QWEN:
        body["reasoning_effort"] = "none"
    whole = chat(live, **body)["choices"][0]
    with completions.inference(live, "alice", KEYS) as http:
        response = http.post(ROUTE, json={**body, "stream": True})
    assert response.status_code == 200, response.text
    message, finish, _ = completions.chat_message(response)
    assert finish == whole["finish_reason"] == "tool_calls"
    assert message.get("content") in (None, "")
    calls = [(c["index"], c["function"]) for c in message["tool_calls"]]
    assert calls == [(k, c["function"]) for k, c in enumerate(whole["message"]["tool_calls"])]


def test_the_sdk_forces_a_call_and_reads_it(live: LiveServer, fw_python_latest: Path) -> None:
    sdk = client_script(
        "model, messages, tools",
        "r = client.chat.completions.create(model=model, messages=json.loads(messages),"
        " tools=json.loads(tools), tool_choice={'type': 'function', 'function': {'name': 'add'}},"
        " max_tokens=160, seed=10, n=3)\n"
        "print(json.dumps([[[[t.function.name, t.function.arguments]"
        " for t in c.message.tool_calls or []], c.finish_reason] for c in r.choices]))\n",
    )
    argv = [live.url, KEYS["alice"], LLAMA, json.dumps(ASK), json.dumps(TOOLS)]
    answers = run_inline(fw_python_latest, sdk, argv)
    finished = [calls for calls, finish in answers if finish == "tool_calls"]
    assert finished, answers
    for calls in finished:
        ((name, arguments),) = calls
        assert name == "add" and _fits(json.loads(arguments), ADD)


def _accepts(model_dir: Path, grammar: str, text: str) -> bool:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=[1])
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_lark(grammar))
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


CALL = '<tool_call>\n{"name": "flip", "arguments": {"on": true}}\n</tool_call>'


@pytest.mark.parametrize(
    ("thinking", "text", "accepted"),
    [
        ("off", CALL, True),
        ("off", f"<think>\nhm\n</think>\n\n{CALL}", False),
        ("off", f"sure {CALL}", False),
        ("off", CALL.replace(", ", ","), False),  # not as the template writes it
        ("off", f"{CALL}\n{CALL}", True),
        ("optional", CALL, True),
        ("optional", f"<think>\nfirst </thin a </think>\n\n{CALL}", True),
        ("optional", f"<think>\nhm\n</think>\n\nsure {CALL}", False),
        ("open", f"hm, flip it\n</think>\n\n{CALL}", True),
        ("open", CALL, False),
    ],
)
def test_the_reply_may_think_where_the_template_thinks(
    models: dict[str, Path], thinking: Any, text: str, accepted: bool
) -> None:
    grammar = calls_grammar(Forced(None), TOOLS, HERMES, Thought(thinking)).text
    assert _accepts(models[QWEN], grammar, text) is accepted


def test_a_named_call_is_one_and_its_arguments_the_schemas(models: dict[str, Path]) -> None:
    grammar = calls_grammar(Forced("add"), TOOLS, XML, Thought("off")).text
    call = "<tool_call>\n<function=add>\n<parameter=a>\n3\n</parameter>\n"
    call += "<parameter=b>\nFalse\n</parameter>\n</function>\n</tool_call>"
    assert _accepts(models[LLAMA], grammar, call)
    assert not _accepts(models[LLAMA], grammar, f"{call}\n{call}")  # one call
    assert not _accepts(models[LLAMA], grammar, call.replace("3", "12"))  # maximum 9
    assert not _accepts(models[LLAMA], grammar, call.replace("False", "false"))
    assert not _accepts(models[LLAMA], grammar, call.replace("add", "flip"))
    missing_b = call.replace("<parameter=b>\nFalse\n</parameter>\n", "")
    assert not _accepts(models[LLAMA], grammar, missing_b)  # b is required
    with_op = call.replace("</function>", "<parameter=op>\nminus\n</parameter>\n</function>")
    assert _accepts(models[LLAMA], grammar, with_op)
    text_tool = [
        {
            "type": "function",
            "function": {"name": "say", "parameters": {"properties": {"t": {"type": "string"}}}},
        }
    ]
    said = "<tool_call>\n<function=say>\n<parameter=t>\nany <b>text</b>\n\n</parameter>\n"
    said += "</function>\n</tool_call>"
    assert _accepts(
        models[LLAMA], calls_grammar(Forced(None), text_tool, XML, Thought("off")).text, said
    )


BROKEN = [{"type": "function", "function": {"name": "x", "parameters": {"type": "frobnicate"}}}]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "tool"}}, "tool_choice.type"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function.name"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "sub"}}},
            "tool_choice.function.name",
        ),
        ({"tools": BROKEN, "tool_choice": "required"}, "tools[0].function.parameters"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
    ],
)
def test_what_a_forced_call_cannot_be_is_a_400_naming_it(
    live: LiveServer, body: dict[str, Any], param: str
) -> None:
    error = chat(live, 400, model=QWEN, messages=ASK, **body)["error"]
    assert error["param"] == param, error


def test_added_tags_are_drawn_as_their_tokens(live: LiveServer, models: dict[str, Path]) -> None:
    """A tag the tokenizer holds as one added token is drawn as that token, as the model
    writes it, never spelled out in pieces (which llguidance would not allow either way)."""
    tokenizer = AutoTokenizer.from_pretrained(models[TAGGED])
    start, end = tokenizer.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    body = {"model": TAGGED, "messages": ASK, "tools": TOOLS, "tool_choice": "required"}
    body |= {"n": 4, "max_tokens": 60, "seed": 11, "temperature": 1.0, "return_token_ids": True}
    choices = chat(live, **body, reasoning_effort="none")["choices"]
    finished = [c for c in choices if c["finish_reason"] == "tool_calls"]
    assert finished, choices
    for choice in finished:
        calls = check_answer(models, TAGGED, choice, {"add", "flip"})
        ids = choice["token_ids"]
        assert ids.count(start) == ids.count(end) == len(calls)


def test_thinking_ends_at_the_added_tag(models: dict[str, Path]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(models[TAGGED])
    grammar = calls_grammar(Forced(None), TOOLS, HERMES, Thought("optional", frozenset(TAGS))).text
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=[1])

    def accepts(ids: list[int]) -> bool:
        matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_lark(grammar))
        return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()

    def spelled(text: str) -> list[int]:  # each character alone: the tags in pieces
        return [t for ch in text for t in tokenizer.encode(ch, add_special_tokens=False)]

    def tokens(text: str) -> list[int]:
        return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]

    assert accepts(tokens(f"<think>\nhm, a </thin b\n</think>\n\n{CALL}"))
    assert accepts(tokens(CALL))
    assert not accepts(spelled("<tool_call>") + tokens(CALL.removeprefix("<tool_call>")))
    thought_spelled = tokens("<think>\nhm") + spelled("</think>") + tokens(f"\n</think>\n\n{CALL}")
    assert not accepts(thought_spelled)  # the thought may not hold the tag spelled out
