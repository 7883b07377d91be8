"""`POST /inference/v1/chat/completions` against independent references, on two families: the
prompt is the conversation written out by hand in the template's format (the ids the
tokenizer gives that text), greedy tokens and logprobs are a plain transformers float32 loop
over the base weights, a sampled chat is the text route's completion of the same ids at the
same seed (on a trained checkpoint too), and the stream puts together into the whole answer.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.api.conftest import LiveServer, serve_in_thread
from tests.api.team_helpers import write_keys
from tests.fireworks import test_completions as completions
from tests.fireworks.conftest import SCRIPTS, client_script, run_fw, run_inline
from tests.fireworks.test_completions import events, trained_checkpoint
from tests.tinker.conftest import build_served_model
from trainer.api.keys import KeyRing

pytestmark = pytest.mark.fireworks

QWEN = "accounts/fireworks/models/qwen3-chat"
LLAMA = "accounts/fireworks/models/llama-chat"
PLAIN = "accounts/fireworks/models/qwen3-no-template"  # a tokenizer without a chat template
ROUTE = "/inference/v1/chat/completions"
POSITIONS = 96
EOS = 1  # <|im_end|>
TOL = 1e-4
TEMPLATE = (
    "{% if messages[0]['role'] == 'tool' %}"
    "{{ raise_exception('a conversation cannot open with a tool result') }}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "answer is 0 or 1 ."},
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "what is two plus "},
            {"type": "text", "text": "three ?"},
        ],
    },
]
# Qwen3's thinking switch: `enable_thinking` false writes an empty think block (the Qwen3
# model's template; the Llama's has none)
SWITCHED = TEMPLATE + (
    "{% if add_generation_prompt and enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}"
)
WRITTEN = (  # MESSAGES in the template's format, by hand
    "<|im_start|>system\nanswer is 0 or 1 .<|im_end|>\n"
    "<|im_start|>user\nwhat is two plus three ?<|im_end|>\n<|im_start|>assistant\n"
)
KEYS: dict[str, str] = {}


@pytest.fixture(scope="module")
def chat_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat-models")
    out: dict[str, Path] = {}
    for name, arch, seed in ((QWEN, "qwen3", 0), (LLAMA, "llama", 3), (PLAIN, "qwen3", 2)):
        where = root / name.rsplit("/", 1)[1]
        build_served_model(
            where, scale=8.0, seed=seed, tokenizer_dir=where, arch=arch, positions=POSITIONS
        )
        if name != PLAIN:
            tokenizer = AutoTokenizer.from_pretrained(where)
            tokenizer.chat_template = SWITCHED if name == QWEN else TEMPLATE
            tokenizer.save_pretrained(where)
        out[name] = where
    return out


@pytest.fixture(scope="module")
def live(
    chat_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    KEYS.update(write_keys(path, (), ("alice", "bob")))
    storage = tmp_path_factory.mktemp("chat-storage")
    with serve_in_thread(storage, chat_models, keys=KeyRing(path)) as server:
        yield server


def tinker(live: LiveServer, user: str) -> httpx.Client:
    return completions.tinker(live, user, KEYS)


def client(live: LiveServer, user: str) -> httpx.Client:
    return completions.inference(live, user, KEYS)


def chat(http: httpx.Client, **body: Any) -> dict[str, Any]:
    response = http.post(ROUTE, json=body)
    assert response.status_code == 200, response.text
    out: dict[str, Any] = response.json()
    return out


def refused(http: httpx.Client, status: int, **body: Any) -> dict[str, Any]:
    response = http.post(ROUTE, json=body)
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    return error


def written_ids(model_dir: Path, text: str = WRITTEN) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


@torch.no_grad()
def greedy(
    model_dir: Path, prompt: list[int], max_new: int
) -> tuple[list[int], list[torch.Tensor]]:
    """Plain transformers, float32, the whole sequence each step: the argmax tokens until EOS
    (kept) or `max_new`, and each step's log-distribution."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens: list[int] = []
    dists: list[torch.Tensor] = []
    while len(tokens) < max_new:
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, -1].float()
        dists.append(torch.log_softmax(logits, dim=-1))
        tokens.append(int(logits.argmax()))
        if tokens[-1] == EOS:
            break
    return tokens, dists


@pytest.mark.parametrize("base", [QWEN, LLAMA])
def test_greedy_chat_is_the_template_and_the_plain_forward(
    live: LiveServer, chat_models: dict[str, Path], base: str
) -> None:
    prompt = written_ids(chat_models[base])
    expected, dists = greedy(chat_models[base], prompt, 12)
    tokenizer = AutoTokenizer.from_pretrained(chat_models[base])
    with client(live, "alice") as http:
        out = chat(
            http,
            model=base,
            messages=MESSAGES,
            max_completion_tokens=12,
            temperature=0,
            logprobs=True,
            top_logprobs=3,
            return_token_ids=True,
            raw_output=True,
        )
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    assert out["prompt_token_ids"] == prompt
    (choice,) = out["choices"]
    assert choice["token_ids"] == expected
    assert choice["message"] == {
        "role": "assistant",
        "content": tokenizer.decode(expected, skip_special_tokens=True),
    }
    assert choice["finish_reason"] == ("stop" if expected[-1] == EOS else "length")
    raw = choice["raw_output"]
    assert raw["prompt_fragments"] == [WRITTEN] and raw["prompt_token_ids"] == prompt
    assert raw["completion_token_ids"] == expected
    assert raw["completion"] == tokenizer.decode(expected, skip_special_tokens=False)
    assert out["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": len(expected),
        "total_tokens": len(prompt) + len(expected),
    }
    rows = choice["logprobs"]["content"]
    assert [row["token_id"] for row in rows] == expected
    offsets = [sum(len(row["token"]) for row in rows[:j]) for j in range(len(rows))]
    assert [row["text_offset"] for row in rows] == offsets
    for token, row, dist in zip(expected, rows, dists, strict=True):
        assert abs(row["logprob"] - dist[token].item()) <= TOL
        assert row["bytes"] == list(row["token"].encode("utf-8"))
        values, ids = torch.topk(dist, 3)
        assert [c["token_id"] for c in row["top_logprobs"]] == ids.tolist()
        got = torch.tensor([c["logprob"] for c in row["top_logprobs"]])
        assert torch.allclose(got, values, atol=TOL)


@pytest.mark.parametrize("base", [QWEN, LLAMA])
def test_without_max_tokens_a_chat_may_fill_the_context(
    live: LiveServer, chat_models: dict[str, Path], base: str
) -> None:
    """No `max_tokens`: the rest of the context after the prompt (as vLLM's chat does), not
    the text route's 16. At these seeds the Qwen3 ends on EOS after 32 tokens, the Llama runs
    to the end of its context."""
    prompt = written_ids(chat_models[base])
    expected, _ = greedy(chat_models[base], prompt, POSITIONS - len(prompt))
    with client(live, "alice") as http:
        out = chat(http, model=base, messages=MESSAGES, temperature=0, return_token_ids=True)
    (choice,) = out["choices"]
    assert choice["token_ids"] == expected and len(expected) > 16
    if base == QWEN:
        assert choice["finish_reason"] == "stop" and expected[-1] == EOS
    else:
        assert choice["finish_reason"] == "length"
        assert len(prompt) + len(expected) == POSITIONS


def completion_of(http: httpx.Client, **body: Any) -> dict[str, Any]:
    response = http.post("/inference/v1/completions", json=body)
    assert response.status_code == 200, response.text
    out: dict[str, Any] = response.json()
    return out


@pytest.mark.parametrize("base", [QWEN, LLAMA])
def test_a_chat_is_the_completion_of_its_rendered_prompt(
    live: LiveServer, chat_models: dict[str, Path], base: str
) -> None:
    """Sampled, seeded, n = 2, on a LoRA checkpoint alice trained: the chat's ids, text and
    logprobs are the text route's for the written prompt at the same seed; and streamed, the
    deltas put together are the whole answer (the role once, first; the finish reason, the
    logprobs and the usage at the end)."""
    with tinker(live, "alice") as http:
        path = trained_checkpoint(http, base, f"chat-{base.rsplit('/', 1)[1]}")
    prompt = written_ids(chat_models[base])
    settings = {"temperature": 1.0, "top_k": 6, "seed": 5, "n": 2, "max_tokens": 10}
    with client(live, "alice") as http:
        text = completion_of(
            http, model=path, prompt=prompt, logprobs=True, raw_output=True, **settings
        )
        out = chat(
            http, model=path, messages=MESSAGES, logprobs=True, return_token_ids=True, **settings
        )
        response = http.post(
            ROUTE,
            json={
                "model": path,
                "messages": MESSAGES,
                "logprobs": True,
                "stream": True,
                **settings,
            },
        )
    assert len(out["choices"]) == 2
    for mine, theirs in zip(out["choices"], text["choices"], strict=True):
        assert mine["token_ids"] == theirs["raw_output"]["completion_token_ids"]
        assert mine["message"]["content"] == theirs["text"]
        assert mine["finish_reason"] == theirs["finish_reason"]
        ours = [row["logprob"] for row in mine["logprobs"]["content"]]
        assert ours == [row["logprob"] for row in theirs["logprobs"]["content"]]
    assert response.status_code == 200, response.text
    chunks = events(response)
    assert chunks[-1] == "[DONE]"
    whole = [{"content": "", "roles": [], "rows": []} for _ in range(2)]
    for chunk in chunks[:-2]:
        assert isinstance(chunk, dict) and chunk["object"] == "chat.completion.chunk"
        for part in chunk["choices"]:
            got = whole[part["index"]]
            assert "finish_reason" not in got, "a chunk after the choice's finish"
            if "role" in part["delta"]:
                got["roles"].append(part["delta"]["role"])
            got["content"] += part["delta"].get("content", "")
            if part["finish_reason"] is not None:
                got["finish_reason"] = part["finish_reason"]
                got["rows"] = part["logprobs"]["content"]
    usage = chunks[-2]
    assert isinstance(usage, dict) and usage["choices"] == [] and usage["usage"] == out["usage"]
    for got, want in zip(whole, out["choices"], strict=True):
        assert got["roles"] == ["assistant"]
        assert got["content"] == want["message"]["content"]
        assert got["finish_reason"] == want["finish_reason"]
        assert got["rows"] == want["logprobs"]["content"]
    # another user's checkpoint answers exactly as a missing one
    with client(live, "bob") as http:
        theirs = refused(http, 404, model=path, messages=MESSAGES)
        missing = refused(http, 404, model=path.replace("chat-", "none-"), messages=MESSAGES)
    assert theirs["param"] == missing["param"] == "model"
    assert theirs["message"].replace(path, "X") == missing["message"].replace(
        path.replace("chat-", "none-"), "X"
    )


def test_echo_scores_the_rendered_prompt(live: LiveServer, chat_models: dict[str, Path]) -> None:
    """`echo` with `max_tokens: 0`: the rendered prompt's rows, each the plain forward's
    logprob of the token given its prefix (the cookbook's renderer probe asks with echo)."""
    prompt = written_ids(chat_models[QWEN])
    model = AutoModelForCausalLM.from_pretrained(chat_models[QWEN], dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0], dim=-1)
    with client(live, "alice") as http:
        out = chat(http, model=QWEN, messages=MESSAGES, max_tokens=0, echo=True, logprobs=True)
    (choice,) = out["choices"]
    rows = choice["logprobs"]["content"]
    assert [row["token_id"] for row in rows] == prompt
    for t in range(1, len(prompt)):
        assert abs(rows[t]["logprob"] - logprobs[t - 1, prompt[t]].item()) <= TOL
    assert choice["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 0


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"reasoning_effort": "low"}, "reasoning_effort"),
        ({"messages": None}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ]
            },
            "messages[0].content[0].type",
        ),
        ({"messages": [{"role": "user", "content": "hi", "colour": 1}]}, "messages[0].colour"),
        ({"messages": [{"role": "tool", "content": "4"}]}, "messages"),  # the template refuses
        ({"prompt": "hi"}, "prompt"),
        ({"max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens"),
        ({"max_completion_tokens": -1}, "max_completion_tokens"),
        ({"max_tokens": POSITIONS}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "the " * POSITIONS}]}, "messages"),
        ({"context_length_exceeded_behavior": "truncate"}, "context_length_exceeded_behavior"),
        ({"temperature": -1}, "temperature"),
        ({"stop": [""]}, "stop[0]"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"model": PLAIN}, "model"),
    ],
)
def test_bad_chat_requests_are_400s_naming_the_field(
    live: LiveServer, body: dict[str, Any], param: str
) -> None:
    with client(live, "alice") as http:
        error = refused(http, 400, **{"model": QWEN, "messages": MESSAGES, **body})
    assert error["param"] == param, error
    assert error["message"].startswith(param) or param in error["message"], error


def test_the_chat_route_checks_the_key(live: LiveServer) -> None:
    with httpx.Client(base_url=live.url, timeout=30) as http:
        response = http.post(ROUTE, json={"model": QWEN, "messages": MESSAGES})
        assert response.status_code == 401, response.text
        response = http.post(
            "/v1/chat/completions",
            json={"model": QWEN, "messages": MESSAGES},
            headers={"Authorization": "Bearer not-a-key"},
        )
        assert response.status_code == 401, response.text


def test_the_v1_spelling_streams(live: LiveServer) -> None:
    """The `/v1` spelling streams too, each event one JSON object on a `data:` line."""
    with client(live, "alice") as http:
        response = http.post(
            "/v1/chat/completions",
            json={"model": QWEN, "messages": MESSAGES, "max_tokens": 3, "stream": True},
        )
    assert response.status_code == 200 and response.headers["content-type"].startswith(
        "text/event-stream"
    )
    payloads = [b[len("data: ") :] for b in response.text.split("\n\n") if b.strip()]
    assert payloads[-1] == "[DONE]"
    assert all(isinstance(json.loads(p), dict) for p in payloads[:-1])


def test_the_fireworks_sdk_reads_the_chat_answer(
    live: LiveServer, chat_models: dict[str, Path], fw_python: Path
) -> None:
    """`Fireworks().chat.completions.create`, whole and streamed, on each SDK line: its types
    parse the answer, and it is the plain forward's greedy chat."""
    prompt = written_ids(chat_models[QWEN])
    expected, dists = greedy(chat_models[QWEN], prompt, 12)
    text = AutoTokenizer.from_pretrained(chat_models[QWEN]).decode(
        expected, skip_special_tokens=True
    )
    argv = [str(SCRIPTS / "chat.py"), QWEN, json.dumps(MESSAGES)]
    out = run_fw(fw_python, live, argv, api_key=KEYS["alice"])
    whole, streamed = out["whole"], out["streamed"]
    assert whole["object"] == "chat.completion" and whole["role"] == "assistant"
    assert whole["content"] == text == streamed["content"]
    assert whole["token_ids"] == expected and whole["completion_tokens"] == len(expected)
    assert whole["prompt_token_ids"] == prompt == whole["raw_prompt_token_ids"]
    assert whole["finish_reason"] == streamed["finish_reason"] == "length"
    assert streamed["roles"] == ["assistant"]
    for token, logprob, dist in zip(expected, whole["logprobs"], dists, strict=True):
        assert abs(logprob - dist[token].item()) <= TOL
    # the text route of the same ids, through the SDK's typed logprobs and raw output
    plain = out["text"]
    assert plain["token_ids"] == expected and plain["logprobs"] == whole["logprobs"]
    assert plain["text"] == text and plain["fragments"] == prompt
    assert plain["offsets"][0] == 0 and plain["offsets"] == sorted(plain["offsets"])


def test_the_cookbooks_renderer_probe_reads_the_chat_answer(
    live: LiveServer, chat_models: dict[str, Path], cookbook_py: Path, cookbook: Path
) -> None:
    """The cookbook's renderer verifier asks the deployment for a chat with echo, raw output
    and token ids (`training/renderer/verifier/utils/probe.py: _call_completion`, run unchanged
    with the SDK's client): it gets the rendered prompt's ids, and the completion's once it
    strips the echoed prompt as it does."""
    prompt = written_ids(chat_models[QWEN])
    expected, _ = greedy(chat_models[QWEN], prompt, 6)
    script = client_script(
        "model, messages",
        "out = _call_completion(client, model=model, messages=json.loads(messages), tools=None,"
        " max_tokens=6, temperature=0.0, extra_kwargs=None)\n"
        "out.pop('raw_payload')\n"
        "print(json.dumps(out))\n",
        imports="from training.renderer.verifier.utils.probe import _call_completion\n",
    )
    argv = [live.url, KEYS["alice"], QWEN, json.dumps(MESSAGES)]
    out = run_inline(cookbook_py, script, argv, cookbook)
    assert out["prompt_token_ids"] == prompt
    assert out["completion_token_ids"] == prompt + expected  # echoed, as the probe expects
    assert out["stop_reason"] == "length"


def test_a_template_that_fails_on_the_messages_is_a_400(live: LiveServer) -> None:
    """Whatever a template raises while it renders the caller's messages (here a TypeError:
    text plus a number) is about those messages: a 400 naming `messages`, never a 500."""
    from trainer.serving.operations import tokenizer_of

    tokenizer = tokenizer_of(live.worker, QWEN)
    assert tokenizer is not None
    kept = tokenizer.chat_template
    tokenizer.chat_template = "{{ messages[0]['content'] + 1 }}"
    try:
        with client(live, "alice") as http:
            error = refused(http, 400, model=QWEN, messages=MESSAGES, max_tokens=2)
    finally:
        tokenizer.chat_template = kept
    assert error["param"] == "messages" and "refuses them" in error["message"], error


@pytest.mark.parametrize(
    "off",
    [{"reasoning_effort": "none"}, {"reasoning_effort": False}, {"thinking": {"type": "disabled"}}],
)
def test_thinking_off_sets_the_templates_switch(
    live: LiveServer, chat_models: dict[str, Path], off: dict[str, Any]
) -> None:
    """`reasoning_effort: none` (or false, or `thinking: {type: disabled}`) renders with the
    template's `enable_thinking` false: the Qwen3 template's empty think block, written by
    hand. A template without the switch cannot turn thinking off: a 400 naming the field."""
    empty = WRITTEN + "<think>\n\n</think>\n\n"
    with client(live, "alice") as http:
        out = chat(http, model=QWEN, messages=MESSAGES, max_tokens=2, return_token_ids=True, **off)
        assert out["prompt_token_ids"] == written_ids(chat_models[QWEN], empty)
        assert out["prompt_token_ids"] != written_ids(chat_models[QWEN])
        (field,) = off
        error = refused(http, 400, model=LLAMA, messages=MESSAGES, max_tokens=2, **off)
        assert error["param"] == field and "enable_thinking" in error["message"], error
        both = {"reasoning_effort": "none", "thinking": {"type": "disabled"}}
        error = refused(http, 400, model=QWEN, messages=MESSAGES, **both)
        assert error["param"] == "thinking", error


@pytest.mark.parametrize(
    "on", [{"reasoning_effort": True}, {"thinking": {"type": "enabled"}}], ids=["true", "enabled"]
)
def test_thinking_on_sets_the_templates_switch(
    live: LiveServer, chat_models: dict[str, Path], on: dict[str, Any]
) -> None:
    """`reasoning_effort: true` (or `thinking: {type: enabled}`) renders with the template's
    `enable_thinking` true: no empty think block. A template that neither has the switch nor
    thinks cannot turn thinking on; a token budget is not served: 400s naming the field."""
    (field,) = on
    with client(live, "alice") as http:
        out = chat(http, model=QWEN, messages=MESSAGES, max_tokens=2, return_token_ids=True, **on)
        assert out["prompt_token_ids"] == written_ids(chat_models[QWEN])
        error = refused(http, 400, model=LLAMA, messages=MESSAGES, max_tokens=2, **on)
        assert error["param"] == field and "enable_thinking" in error["message"], error
        budget = (
            {"reasoning_effort": 2048}
            if field == "reasoning_effort"
            else {"thinking": {"type": "enabled", "budget_tokens": 2048}}
        )
        error = refused(http, 400, model=QWEN, messages=MESSAGES, **budget)
        assert error["param"] == field, error
