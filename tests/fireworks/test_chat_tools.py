"""Tools on `POST /inference/v1/chat/completions` (docs/semantics.md §25a): the tools are written
into the prompt by the model's own template (the ids of the conversation written out by hand),
and a completion's Hermes-style calls come back as `tool_calls`, parsed by the test's own
reading of the completion's token ids. The model is a tiny Qwen3 whose LoRA adapter was
trained through the Tinker routes to answer with a call, so the call is the model's own output,
sampled greedily."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from tests.api.conftest import LiveServer, serve_in_thread
from tests.api.team_helpers import write_keys
from tests.fireworks import test_completions as completions
from tests.fireworks.conftest import client_script, run_inline
from tests.tinker import tinker_http as th
from tests.tinker.conftest import VOCAB, build_served_model
from trainer.api.keys import KeyRing

pytestmark = pytest.mark.fireworks

HERMES = "accounts/fireworks/models/qwen3-tools"
PLAIN = "accounts/fireworks/models/qwen3-no-tools"  # a template that writes no calls
XML = "accounts/fireworks/models/qwen35-tools"  # Qwen3.5's way: <function=...> XML
ROUTE = "/inference/v1/chat/completions"
START, END = "<tool_call>", "</tool_call>"
CALL = '{"name": "add", "arguments": {"a": 2, "b": 3}}'
TC, ETC, CALL_ID = len(VOCAB), len(VOCAB) + 1, len(VOCAB) + 2  # the extra tokens' ids
EOS, TWO = 1, VOCAB.index("two")
TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}\n{{ t['function']['name'] }}"
    "{% endfor %}\n</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% if m['tool_calls'] is defined %}{% for c in m['tool_calls'] %}"
    "<tool_call>\n{{ c['function'] | tojson }}\n</tool_call>{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
XML_TEMPLATE = TEMPLATE.replace(
    "<tool_call>\n{{ c['function'] | tojson }}\n</tool_call>",
    "<tool_call>\n<function={{ c['function']['name'] }}>\n"
    "{% for k, v in c['function']['arguments'].items() %}<parameter={{ k }}>\n{{ v }}\n"
    "</parameter>\n{% endfor %}</function>\n</tool_call>",
)
XML_TAGS = (START, END, "<function=add>", "</function>", "<parameter=a>", "<parameter=b>")
XML_TAGS += ("</parameter>",)
X_START, X_END, X_FN, X_EFN, X_A, X_B, X_EP = range(len(VOCAB), len(VOCAB) + len(XML_TAGS))
NO_CALLS = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "a plus b",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "number"}},
            },
        },
    }
]
ASK = [{"role": "user", "content": "what is two plus three ?"}]
WITH_TOOLS = (
    "<|im_start|>system\n<tools>\nadd\n</tools><|im_end|>\n"
    "<|im_start|>user\nwhat is two plus three ?<|im_end|>\n<|im_start|>assistant\n"
)
WITHOUT = "<|im_start|>user\nwhat is two plus three ?<|im_end|>\n<|im_start|>assistant\n"
KEYS: dict[str, str] = {}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tool-models")
    out: dict[str, Path] = {}
    hermes = (START, END, CALL)
    for name, template, extra in (
        (HERMES, TEMPLATE, hermes),
        (PLAIN, NO_CALLS, hermes),
        (XML, XML_TEMPLATE, XML_TAGS),
    ):
        where = root / name.rsplit("/", 1)[1]
        build_served_model(where, 8.0, 4, where, positions=96, extra=extra)
        tokenizer = AutoTokenizer.from_pretrained(where)
        tokenizer.chat_template = template
        tokenizer.save_pretrained(where)
        out[name] = where
    return out


@pytest.fixture(scope="module")
def live(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    KEYS.update(write_keys(path, (), ("alice",)))
    storage = tmp_path_factory.mktemp("tools-storage")
    with serve_in_thread(storage, models, keys=KeyRing(path)) as server:
        yield server


def ids(models: dict[str, Path], text: str, model: str = HERMES) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(models[model])
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


def trained(live: LiveServer, base: str, data: list[dict[str, Any]], name: str) -> str:
    """A LoRA sampler checkpoint of `base` trained with cross entropy on `data` through the
    Tinker routes until it says it greedily: its tinker path."""
    with completions.tinker(live, "alice", KEYS) as http:
        session = th.new_session(http)
        body = {"session_id": session, "model_seq_id": 0, "base_model": base}
        body["lora_config"] = {"rank": 8, "seed": 0}
        model_id = th.ok(http, "/create_model", body)["model_id"]
        fb = {
            "model_id": model_id,
            "forward_backward_input": {"data": data, "loss_fn": "cross_entropy"},
        }
        for _ in range(30):
            th.ok(http, "/forward_backward", fb)
            th.ok(http, "/optim_step", th.optim_body(model_id, lr=1e-2))
        saved = th.ok(http, "/save_weights_for_sampler", {"model_id": model_id, "path": name})
    return str(saved["path"])


@pytest.fixture(scope="module")
def caller(live: LiveServer, models: dict[str, Path]) -> str:
    """A sampler checkpoint that answers "two", then calls `add` (after the prompt with tools,
    and after the one without)."""
    answer = [TWO, TC, CALL_ID, ETC, EOS]
    data = [th.datum(ids(models, text) + answer) for text in (WITH_TOOLS, WITHOUT)]
    return trained(live, HERMES, data, "caller")


def chat(live: LiveServer, status: int = 200, **body: Any) -> dict[str, Any]:
    with completions.inference(live, "alice", KEYS) as http:
        response = http.post(ROUTE, json={"max_tokens": 8, "temperature": 0, **body})
    assert response.status_code == status, response.text
    out: dict[str, Any] = response.json()
    return out


def streamed(live: LiveServer, **body: Any) -> dict[str, Any]:
    with completions.inference(live, "alice", KEYS) as http:
        body = {"max_tokens": 8, "temperature": 0, **body, "stream": True}
        response = http.post(ROUTE, json=body)
    assert response.status_code == 200, response.text
    message, finish, _ = completions.chat_message(response)
    return {"message": message, "finish_reason": finish}


def reference_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """The test's own reading of a completion: the text before the first tag, and each
    tagged JSON object's name and arguments (re-written as JSON)."""
    found = re.findall(r"<tool_call>(.*?)</tool_call>", text, flags=re.DOTALL)
    calls = []
    for inner in found:
        call = json.loads(inner)
        calls.append({"name": call["name"], "arguments": json.dumps(call["arguments"])})
    head = text.split(START)[0]
    return (head or None), calls


def test_a_called_tool_comes_back_as_tool_calls(
    live: LiveServer, models: dict[str, Path], caller: str
) -> None:
    out = chat(live, model=caller, messages=ASK, tools=TOOLS, return_token_ids=True)
    assert out["prompt_token_ids"] == ids(models, WITH_TOOLS)  # the tools are in the prompt
    (choice,) = out["choices"]
    assert choice["token_ids"][-4:] == [TC, CALL_ID, ETC, EOS], choice  # the model's call
    tokenizer = AutoTokenizer.from_pretrained(models[HERMES])
    text = tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
    head, calls = reference_calls(text)
    assert calls == [{"name": "add", "arguments": json.dumps({"a": 2, "b": 3})}]
    message = choice["message"]
    assert message["role"] == "assistant" and message["content"] == head == "two "
    got = message["tool_calls"]
    assert [c["function"] for c in got] == calls
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in got), got
    assert choice["finish_reason"] == "tool_calls"


def test_tool_choice_none_neither_renders_nor_parses(
    live: LiveServer, models: dict[str, Path], caller: str
) -> None:
    """`tool_choice: none`: the conversation as without tools, and the completion all text."""
    out = chat(
        live, model=caller, messages=ASK, tools=TOOLS, tool_choice="none", return_token_ids=True
    )
    assert out["prompt_token_ids"] == ids(models, WITHOUT)
    (choice,) = out["choices"]
    assert choice["token_ids"][-4:] == [TC, CALL_ID, ETC, EOS], choice
    assert START in choice["message"]["content"] and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"


def test_a_conversation_with_calls_and_results_renders_them(
    live: LiveServer, models: dict[str, Path]
) -> None:
    """An assistant turn's `tool_calls` and a `tool` result reach the template, the call's
    arguments as a JSON object whether sent as one or written out as a string (as a reply's
    calls come, and clients send them back)."""
    function: dict[str, Any] = {"name": "add", "arguments": {"a": 2}}
    spelled = {**function, "arguments": '{"a": 2}'}
    prompts = []
    for sent in (function, spelled):
        call = {"id": "call_1", "type": "function", "function": sent}
        messages = [
            *ASK,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "5"},
        ]
        out = chat(live, model=HERMES, messages=messages, tools=TOOLS, return_token_ids=True)
        prompts.append(out["prompt_token_ids"])
    written = (
        "<|im_start|>system\n<tools>\nadd\n</tools><|im_end|>\n"
        "<|im_start|>user\nwhat is two plus three ?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n'
        "</tool_call><|im_end|>\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    )
    assert prompts == [ids(models, written)] * 2
    broken = {"id": "c", "type": "function", "function": {**function, "arguments": "{a"}}
    bad = [*ASK, {"role": "assistant", "content": None, "tool_calls": [broken]}]
    error = chat(live, 400, model=HERMES, messages=bad, tools=TOOLS)["error"]
    assert error["param"] == "messages[1].tool_calls[0].function.arguments", error


def test_a_call_cut_by_max_tokens_finishes_length(live: LiveServer, caller: str) -> None:
    """The call is read as far as it goes, and the finish reason says it was cut."""
    out = chat(live, model=caller, messages=ASK, tools=TOOLS, max_tokens=3)
    (choice,) = out["choices"]
    (call,) = choice["message"]["tool_calls"]  # "<tool_call> {...}", its end tag not reached
    assert call["function"]["name"] == "add" and choice["finish_reason"] == "length"


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_a_hermes_call_with_a_non_json_number_is_content(constant: str) -> None:
    from trainer.api.fireworks.chat_tools import parse_calls

    text = f'two <tool_call>{{"name": "add", "arguments": {{"a": {constant}}}}}</tool_call>'
    parsed = parse_calls(text)
    assert parsed.calls == [] and parsed.content == text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": HERMES, "tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
        (
            {"model": HERMES, "tools": TOOLS, "tool_choice": {"type": "function"}},
            "tool_choice.function.name",
        ),
        ({"model": PLAIN, "tools": TOOLS}, "tools"),
        ({"model": HERMES, "tools": {"add": 1}}, "tools"),
        ({"model": HERMES, "tools": [{"type": "retrieval"}]}, "tools[0].type"),
        (
            {"model": HERMES, "tools": [{"type": "function", "function": {}}]},
            "tools[0].function.name",
        ),
        ({"model": HERMES, "functions": [{"name": "add"}]}, "functions"),
    ],
    ids=[
        "required-word-level-tokenizer",
        "named-without-name",
        "no-format",
        "not-a-list",
        "type",
        "name",
        "legacy",
    ],
)
def test_what_tools_cannot_do_is_a_400_naming_it(
    live: LiveServer, body: dict[str, Any], param: str
) -> None:
    error = chat(live, 400, messages=ASK, **body)["error"]
    assert error["param"] == param, error


def test_the_sdk_and_the_cookbooks_probe_read_tool_calls(
    live: LiveServer,
    models: dict[str, Path],
    caller: str,
    fw_python_latest: Path,
    cookbook_py: Path,
    cookbook: Path,
) -> None:
    """`Fireworks().chat.completions.create(tools=...)` parses the call into its typed
    `tool_calls`; the cookbook's renderer probe (`_call_completion`, which sends tools) gets
    the prompt the tools are written into."""
    sdk = client_script(
        "model, messages, tools",
        "r = client.chat.completions.create(model=model, messages=json.loads(messages),"
        " tools=json.loads(tools), max_tokens=8, temperature=0)\n"
        "(c,) = r.choices\n"
        "calls = [[t.id, t.type, t.function.name, t.function.arguments]"
        " for t in c.message.tool_calls or []]\n"
        "print(json.dumps({'calls': calls, 'content': c.message.content,"
        " 'finish': c.finish_reason}))\n",
    )
    probe = client_script(
        "model, messages, tools",
        "out = _call_completion(client, model=model, messages=json.loads(messages),"
        " tools=json.loads(tools), max_tokens=8, temperature=0.0, extra_kwargs=None)\n"
        "print(json.dumps(out['prompt_token_ids']))\n",
        imports="from training.renderer.verifier.utils.probe import _call_completion\n",
    )
    argv = [live.url, KEYS["alice"], caller, json.dumps(ASK), json.dumps(TOOLS)]
    typed = run_inline(fw_python_latest, sdk, argv)
    prompt = run_inline(cookbook_py, probe, argv, cookbook)
    ((call_id, kind, name, arguments),) = typed["calls"]
    assert call_id.startswith("call_") and kind == "function" and name == "add"
    assert json.loads(arguments) == {"a": 2, "b": 3}
    assert typed["content"] == "two " and typed["finish"] == "tool_calls"
    assert prompt == ids(models, WITH_TOOLS)


def test_an_xml_call_comes_back_typed_by_the_schema(
    live: LiveServer, models: dict[str, Path]
) -> None:
    """Qwen3.5's form: `<function=add>` with one `<parameter=...>` per argument, each value
    typed by the tool's schema (`a` an integer, `b` a number that is whole)."""
    three, two_ = VOCAB.index("3"), VOCAB.index("2")
    call = [X_START, X_FN, X_A, two_, X_EP, X_B, three, X_EP, X_EFN, X_END]
    prompt = ids(models, WITH_TOOLS, XML)
    answer = trained(live, XML, [th.datum([*prompt, TWO, *call, EOS])], "xml")
    out = chat(live, model=answer, messages=ASK, tools=TOOLS, return_token_ids=True, max_tokens=16)
    assert out["prompt_token_ids"] == prompt
    (choice,) = out["choices"]
    assert choice["token_ids"] == [TWO, *call, EOS], choice
    text = AutoTokenizer.from_pretrained(models[XML]).decode(choice["token_ids"])
    # the test's reading: the function's name, and each parameter's text as its schema types it
    (name,) = re.findall(r"<function=(\w+)>", text)
    found = dict(re.findall(r"<parameter=(\w+)>(.*?)</parameter>", text, flags=re.DOTALL))
    typed = {"a": int(found["a"]), "b": float(found["b"])}
    assert typed == {"a": 2, "b": 3.0}
    (got,) = choice["message"]["tool_calls"]
    assert got["function"] == {"name": name, "arguments": json.dumps({"a": 2, "b": 3})}
    assert choice["message"]["content"] == "two " and choice["finish_reason"] == "tool_calls"


SCHEMA_TOOL = {
    "type": "function",
    "function": {
        "name": "f",
        "parameters": {
            "type": "object",
            "properties": {
                "i": {"type": "integer"},
                "x": {"type": "number"},
                "ok": {"type": "boolean"},
                "obj": {"type": "object"},
                "s": {"type": "string"},
            },
        },
    },
}


@pytest.mark.parametrize(
    ("key", "value", "want"),
    [
        ("i", "\n7\n", 7),
        ("i", "seven", "seven"),  # not an integer: stays text
        ("x", "2.5", 2.5),
        ("x", "4.0", 4),
        ("x", "inf", "inf"),  # JSON has no infinity
        ("ok", "True", True),
        ("ok", "no", False),
        ("obj", '{"k": [1, 2]}', {"k": [1, 2]}),
        ("obj", "{'k': 1}", {"k": 1}),  # a Python literal
        ("obj", "{k", "{k"),
        ("s", "\n\nline\n", "\nline"),  # one newline trimmed from each end
        ("s", "null", None),
        ("other", "5", "5"),  # a key the schema lacks stays text
    ],
)
def test_xml_values_are_typed_by_the_schema(key: str, value: str, want: Any) -> None:
    from trainer.api.fireworks.chat_tools import XML as FORM
    from trainer.api.fireworks.chat_tools import parse_calls

    text = f"ok <tool_call>\n<function=f>\n<parameter={key}>{value}</parameter>\n</function>\n"
    parsed = parse_calls(text + "</tool_call>", FORM, [SCHEMA_TOOL])
    assert parsed.content == "ok "
    (call,) = parsed.calls
    assert call["function"]["name"] == "f"
    assert json.loads(call["function"]["arguments"]) == {key: want}


def test_a_streamed_call_adds_up_to_the_whole_answer(live: LiveServer, caller: str) -> None:
    """The content streams until a call may begin; the last chunk has the rest and the calls,
    numbered by `index`: together, the whole answer's message."""
    whole = chat(live, model=caller, messages=ASK, tools=TOOLS)["choices"][0]
    got = streamed(live, model=caller, messages=ASK, tools=TOOLS)
    assert got["finish_reason"] == whole["finish_reason"] == "tool_calls"
    (call,) = got["message"].pop("tool_calls")
    (want,) = whole["message"].pop("tool_calls")
    assert call["index"] == 0 and call["function"] == want["function"], (call, want)
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert got["message"] == whole["message"] == {"role": "assistant", "content": "two "}


@pytest.mark.parametrize(
    ("text", "xml", "sent"),
    [
        ("two <tool", False, "two "),  # may grow into <tool_call>: held
        ("two <tool_call>{", False, "two "),
        ("two <b>", False, "two <b>"),  # cannot: sent
        ("a <", False, "a "),
        ("a <func", True, "a "),  # the XML form's other mark
        ("a <function=f>", True, "a "),
        ("a <func", False, "a <func"),
    ],
)
def test_a_streamed_reply_holds_what_may_become_a_call(text: str, xml: bool, sent: str) -> None:
    from types import SimpleNamespace

    from trainer.api.fireworks.chat_stream import CallStream
    from trainer.api.fireworks.chat_tools import XML_CALLS

    marks = (START, XML_CALLS) if xml else (START,)
    assert CallStream._visible(SimpleNamespace(marks=marks), text) == sent  # type: ignore[arg-type]
