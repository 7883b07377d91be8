"""`POST /inference/v1/completions` on checkpoints, against independent references: the Tinker
face's own `asample` of the same checkpoint at the same seed (the tokens), a plain
transformers + peft forward of prompt + completion in float32 (`logprobs`, `top_logprobs`, the
echoed prompt's), and a naive tempered top-k formula (`sampling_logprob`), on both families;
streamed and not.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from tests.api.conftest import LiveServer, serve_in_thread
from tests.api.team_helpers import write_keys
from tests.fireworks.conftest import LLAMA, QWEN, run_inline
from tests.tinker import tinker_http as th
from trainer.api.fireworks import completion_run
from trainer.api.keys import KeyRing
from trainer.api.tinker.records import TinkerCheckpoint

pytestmark = pytest.mark.fireworks

KEYS: dict[str, str] = {}  # user -> key, written by `live`
PROMPT = [3, 17, 22, 9, 27, 5]
ROUTE = "/inference/v1/completions"
TOL = 1e-4


@pytest.fixture(scope="module")
def live(
    fw_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    KEYS.update(write_keys(path, (), ("alice", "bob")))
    storage = tmp_path_factory.mktemp("completions-storage")
    with serve_in_thread(storage, fw_models, keys=KeyRing(path)) as server:
        yield server


def tinker(live: LiveServer, user: str, keys: dict[str, str] = KEYS) -> httpx.Client:
    """`user`'s client of the Tinker face (`keys`: another module's server's)."""
    headers = {"X-API-Key": keys[user]}
    return httpx.Client(base_url=f"{live.url}{th.PREFIX}", headers=headers, timeout=120)


def inference(live: LiveServer, user: str, keys: dict[str, str] = KEYS) -> httpx.Client:
    """`user`'s client of the inference routes (`keys`: another module's server's)."""
    headers = {"Authorization": f"Bearer {keys[user]}"}
    return httpx.Client(base_url=live.url, headers=headers, timeout=120)


def trained_checkpoint(http: httpx.Client, base: str, name: str) -> str:
    """A LoRA sampler checkpoint one AdamW step away from the base model: its tinker path."""
    session = th.new_session(http)
    body = {
        "session_id": session,
        "model_seq_id": 0,
        "base_model": base,
        "lora_config": {"rank": 2, "seed": 0},
    }
    model_id = th.ok(http, "/create_model", body)["model_id"]
    data = {"data": [th.datum(PROMPT)], "loss_fn": "cross_entropy"}
    th.ok(http, "/forward_backward", {"model_id": model_id, "forward_backward_input": data})
    th.ok(http, "/optim_step", th.optim_body(model_id, lr=5e-2))
    saved = th.ok(http, "/save_weights_for_sampler", {"model_id": model_id, "path": name})
    path: str = saved["path"]
    return path


def overfit_checkpoint(
    live: LiveServer, keys: dict[str, str], base: str, data: list[dict[str, Any]], name: str
) -> str:
    """Alice's LoRA sampler checkpoint of `base` trained with cross entropy on `data` through
    the Tinker routes until it says it greedily (the chat tests' models that call tools or
    reason): its tinker path."""
    with tinker(live, "alice", keys) as http:
        session = th.new_session(http)
        body = {"session_id": session, "model_seq_id": 0, "base_model": base}
        body["lora_config"] = {"rank": 8, "seed": 0}
        model_id = th.ok(http, "/create_model", body)["model_id"]
        fb = {"data": data, "loss_fn": "cross_entropy"}
        for _ in range(30):
            th.ok(http, "/forward_backward", {"model_id": model_id, "forward_backward_input": fb})
            th.ok(http, "/optim_step", th.optim_body(model_id, lr=1e-2))
        saved = th.ok(http, "/save_weights_for_sampler", {"model_id": model_id, "path": name})
    return str(saved["path"])


def greedy_chat(
    live: LiveServer, keys: dict[str, str], status: int, body: dict[str, Any]
) -> dict[str, Any]:
    """Alice's greedy chat of `body` (temperature 0 unless it says otherwise): the answer,
    after its status is checked."""
    with inference(live, "alice", keys) as http:
        response = http.post("/inference/v1/chat/completions", json={"temperature": 0, **body})
    assert response.status_code == status, response.text
    out: dict[str, Any] = response.json()
    return out


@pytest.fixture(scope="module")
def checkpoints(live: LiveServer) -> dict[str, str]:
    """base model -> alice's trained sampler checkpoint (tinker path)."""
    with tinker(live, "alice") as http:
        return {
            base: trained_checkpoint(http, base, f"s-{i}") for i, base in enumerate((QWEN, LLAMA))
        }


def adapter_dir(live: LiveServer, path: str) -> Path:
    saved = live.app.state.tinker.db.get(TinkerCheckpoint, path)
    record = live.worker.checkpoints.get(saved.checkpoint_id)
    return Path(record.path) / "adapter"


class Reference:
    """The checkpoint as plain transformers + peft compute it, in float32."""

    def __init__(self, base_dir: Path, adapter: Path) -> None:
        base = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
        self.model = PeftModel.from_pretrained(base, adapter).eval()

    @torch.no_grad()
    def logits(self, tokens: list[int]) -> torch.Tensor:
        """[T, V]: row t predicts token t + 1."""
        return self.model(input_ids=torch.tensor([tokens])).logits[0].float()

    def logprobs(self, tokens: list[int]) -> torch.Tensor:
        return torch.log_softmax(self.logits(tokens), dim=-1)


@pytest.fixture(scope="module")
def references(
    live: LiveServer, checkpoints: dict[str, str], fw_models: dict[str, Path]
) -> dict[str, Reference]:
    return {b: Reference(fw_models[b], adapter_dir(live, p)) for b, p in checkpoints.items()}


def complete(http: httpx.Client, **body: Any) -> dict[str, Any]:
    response = http.post(ROUTE, json=body)
    assert response.status_code == 200, response.text
    out: dict[str, Any] = response.json()
    return out


def events(response: httpx.Response) -> list[dict[str, Any] | str]:
    """The SSE `data:` payloads of a stream, `[DONE]` as the string."""
    out: list[dict[str, Any] | str] = []
    for block in response.text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def chat_message(response: httpx.Response) -> tuple[dict[str, Any], str | None, int]:
    """A streamed chat's one choice put together from its deltas: the message as a whole
    answer has it (parts never sent are absent), its finish reason, and how many chunks
    carried it."""
    message: dict[str, Any] = {}
    finish, chunks = None, 0
    for event in events(response):
        if not isinstance(event, dict) or not event["choices"]:
            continue
        chunks += 1
        (part,) = event["choices"]
        for key, value in part["delta"].items():
            if key == "tool_calls":
                message.setdefault(key, []).extend(value)
            else:
                message[key] = value if key == "role" else message.get(key, "") + value
        finish = part.get("finish_reason") or finish
    return message, finish, chunks


def asample(http: httpx.Client, path: str, n: int, **params: Any) -> list[list[int]]:
    """The Tinker face's own sample of the checkpoint: each sequence's tokens."""
    body = {
        "model_path": path,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
        "num_samples": n,
        "sampling_params": params,
    }
    response = http.post("/asample", json=body)
    assert response.status_code == 200, response.text
    result = th.wait(http, response.json()["request_id"])
    return [list(seq["tokens"]) for seq in result["sequences"]]


SAMPLED = {"temperature": 0.7, "top_k": 5, "seed": 11, "max_tokens": 8}


def tempered(logits_V: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """The log-distribution a token is drawn from: logits / T, all but the top k masked."""
    scaled = logits_V / temperature
    kth = torch.topk(scaled, top_k).values[-1]
    return torch.log_softmax(scaled.masked_fill(scaled < kth, float("-inf")), dim=-1)


@pytest.mark.parametrize("base", [QWEN, LLAMA])
def test_completion_matches_tinker_sample_and_references(
    live: LiveServer,
    checkpoints: dict[str, str],
    references: dict[str, Reference],
    base: str,
) -> None:
    path, ref = checkpoints[base], references[base]
    with tinker(live, "alice") as http:
        (expected,) = asample(http, path, 1, **SAMPLED)
    with inference(live, "alice") as http:
        out = complete(
            http,
            model=path,
            prompt=PROMPT,
            logprobs=True,
            top_logprobs=3,
            raw_output=True,
            **SAMPLED,
        )
    assert out["object"] == "text_completion" and out["model"] == path
    (choice,) = out["choices"]
    tokens = choice["raw_output"]["completion_token_ids"]
    assert tokens == expected
    assert choice["raw_output"]["prompt_token_ids"] == PROMPT == choice["prompt_token_ids"]
    assert out["usage"] == {
        "prompt_tokens": len(PROMPT),
        "completion_tokens": len(tokens),
        "total_tokens": len(PROMPT) + len(tokens),
    }
    assert choice["finish_reason"] == ("stop" if len(tokens) < 8 else "length")
    rows = choice["logprobs"]["content"]
    assert [row["token_id"] for row in rows] == tokens
    logits = ref.logits(PROMPT + tokens)
    logprobs = torch.log_softmax(logits, dim=-1)
    for j, (token, row) in enumerate(zip(tokens, rows, strict=True)):
        at = len(PROMPT) - 1 + j
        assert abs(row["logprob"] - logprobs[at, token].item()) <= TOL
        drawn = tempered(logits[at], 0.7, 5)[token].item()
        assert abs(row["sampling_logprob"] - drawn) <= TOL
        values, ids = torch.topk(logprobs[at], 3)
        assert [c["token_id"] for c in row["top_logprobs"]] == ids.tolist()
        got = torch.tensor([c["logprob"] for c in row["top_logprobs"]])
        assert torch.allclose(got, values, atol=TOL)


def stream(http: httpx.Client, **body: Any) -> tuple[httpx.Response, list[dict[str, Any] | str]]:
    response = http.post(ROUTE, json={**body, "stream": True})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    return response, events(response)


def assembled(chunks: list[dict[str, Any] | str], n: int = 1) -> list[dict[str, Any]]:
    """Each choice put together as the SDK does (`async_completions_stream`)."""
    choices: list[dict[str, Any]] = [{"text": "", "content": []} for _ in range(n)]
    for chunk in chunks:
        assert isinstance(chunk, dict)
        for part in chunk["choices"]:
            whole = choices[part["index"]]
            whole["text"] += part.get("text", "")
            if part.get("logprobs"):
                whole["content"].extend(part["logprobs"]["content"])
            for key in ("finish_reason", "raw_output"):
                if part.get(key):
                    whole[key] = part[key]
    return choices


@pytest.mark.parametrize("base", [QWEN, LLAMA])
def test_stream_carries_what_the_whole_answer_does(
    live: LiveServer, checkpoints: dict[str, str], base: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(completion_run, "FLUSH_S", 0.0)  # a chunk per decode step
    path = checkpoints[base]
    body = {"model": path, "prompt": PROMPT, "logprobs": True, "raw_output": True}
    body.update(SAMPLED, max_tokens=12, perf_metrics_in_response=True)
    with inference(live, "alice") as http:
        whole = complete(http, **body)
        response, chunks = stream(http, **body)
        assert response.headers["x-request-id"]
        given = http.post(ROUTE, json={**body, "stream": True}, headers={"X-Request-Id": "abc-1"})
        assert given.headers["x-request-id"] == "abc-1"
        _, three = stream(http, **body, n=3)
    assert chunks[-1] == "[DONE]"
    last = chunks[-2]
    assert isinstance(last, dict) and last["choices"] == []
    assert last["perf_metrics"]["server-time-to-first-token"] > 0
    assert last["perf_metrics"]["prompt-tokens"] == len(PROMPT)
    ids = {c["id"] for c in chunks[:-1] if isinstance(c, dict)}
    assert len(ids) == 1 and "usage" not in chunks[0]  # one completion; usage comes last
    (expected,) = whole["choices"]
    (got,) = assembled(chunks[:-1])
    assert got["raw_output"] == expected["raw_output"]
    assert got["text"] == expected["text"]
    assert got["finish_reason"] == expected["finish_reason"]
    assert got["content"] == expected["logprobs"]["content"]
    assert last["usage"] == whole["usage"]
    tokens = expected["raw_output"]["completion_token_ids"]
    deltas = [c for c in chunks[:-2] if isinstance(c, dict) and c["choices"]]
    assert len(deltas) >= min(len(tokens), 3)  # text came as it was generated
    # n > 1: each choice is the Tinker face's sequence of the same index at the seed
    with tinker(live, "alice") as http:
        expected_three = asample(http, path, 3, **{**SAMPLED, "max_tokens": 12})
    choices = assembled(three[:-1], 3)
    assert [c["raw_output"]["completion_token_ids"] for c in choices] == expected_three
    for choice in choices:
        ids_ = choice["raw_output"]["completion_token_ids"]
        assert [row["token_id"] for row in choice["content"]] == ids_


@pytest.mark.parametrize("stream_it", [False, True])
def test_echo_aligns_prompt_and_completion(
    live: LiveServer,
    checkpoints: dict[str, str],
    references: dict[str, Reference],
    stream_it: bool,
) -> None:
    """`echo`: the prompt's tokens and logprobs come first (P + C rows, the first prompt
    token's 0.0: it is given); `echo_last=k`: only the last k prompt tokens."""
    path, ref = checkpoints[QWEN], references[QWEN]
    body = {"model": path, "prompt": PROMPT, "logprobs": True, "top_logprobs": 2}
    body.update(raw_output=True, temperature=0.0, max_tokens=5, echo=True)
    with inference(live, "alice") as http:
        if stream_it:
            _, chunks = stream(http, **body)
            got = assembled(chunks[:-1])[0]
            first = chunks[0]
            assert isinstance(first, dict) and first["choices"][0]["text"]  # the echo, first
            content, raw = got["content"], got["raw_output"]
        else:
            (choice,) = complete(http, **body)["choices"]
            content, raw = choice["logprobs"]["content"], choice["raw_output"]
        (last_two,) = complete(http, **{**body, "echo": False, "echo_last": 2})["choices"]
    generated = raw["completion_token_ids"][len(PROMPT) :]
    assert raw["completion_token_ids"] == PROMPT + generated
    assert len(content) == len(PROMPT) + len(generated)
    assert [row["token_id"] for row in content] == PROMPT + generated
    logprobs = ref.logprobs(PROMPT + generated)
    assert content[0]["logprob"] == 0.0 and content[0]["sampling_logprob"] is None
    assert [c["token_id"] for c in content[0]["top_logprobs"]] == [PROMPT[0]]
    for i, row in enumerate(content[1:], start=1):
        token = (PROMPT + generated)[i]
        assert abs(row["logprob"] - logprobs[i - 1, token].item()) <= TOL
        values, ids = torch.topk(logprobs[i - 1], 2)
        assert [c["token_id"] for c in row["top_logprobs"]] == ids.tolist()
        assert torch.allclose(
            torch.tensor([c["logprob"] for c in row["top_logprobs"]]), values, atol=TOL
        )
        if i >= len(PROMPT):  # greedy: the drawn-from distribution is a point mass
            assert row["sampling_logprob"] == 0.0
    assert last_two["raw_output"]["completion_token_ids"] == PROMPT[-2:] + generated
    rows = last_two["logprobs"]["content"]
    assert len(rows) == 2 + len(generated)
    assert [r["logprob"] for r in rows] == [r["logprob"] for r in content[-len(rows) :]]


def test_stops_and_finish_reasons(
    live: LiveServer, checkpoints: dict[str, str], fw_models: dict[str, Path]
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(fw_models[QWEN])
    body = {"model": checkpoints[QWEN], "prompt": PROMPT, "raw_output": True}
    body.update(temperature=0.0, max_tokens=10)
    with inference(live, "alice") as http:
        (free,) = complete(http, **body)["choices"]
        tokens = free["raw_output"]["completion_token_ids"]
        eos = tokenizer.eos_token_id
        assert free["finish_reason"] == ("stop" if tokens[-1] == eos else "length")
        assert len(tokens) == 10 or tokens[-1] == eos
        assert free["text"] == tokenizer.decode(tokens, skip_special_tokens=True)
        assert len(tokens) > 3  # so each stop below cuts the sequence short
        at = 3
        (by_id,) = complete(http, **body, stop=[tokens[at]])["choices"]
        cut = tokens.index(tokens[at]) + 1
        assert by_id["raw_output"]["completion_token_ids"] == tokens[:cut]
        assert by_id["finish_reason"] == "stop"
        word = tokenizer.decode([tokens[at]])
        (by_text,) = complete(http, **body, stop=[word])["choices"]
        hit = next(
            k + 1
            for k in range(len(tokens))
            if tokenizer.decode(tokens[: k + 1], skip_special_tokens=True).endswith(word)
        )
        assert by_text["raw_output"]["completion_token_ids"] == tokens[:hit]
        assert by_text["finish_reason"] == "stop"
        (short,) = complete(http, **{**body, "max_tokens": 2})["choices"]
        assert short["raw_output"]["completion_token_ids"] == tokens[:2]
        assert short["finish_reason"] == ("stop" if tokens[1] == eos else "length")


def test_concurrent_completions_merge_into_one_call(
    live: LiveServer,
    checkpoints: dict[str, str],
    references: dict[str, Reference],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Eight unseeded `n: 1` completions sent at once (the SDK's way of asking for a group),
    three prompts among them: the first runs while the others wait, and those run as one
    engine call; every row's logprobs are still the reference's, and a seeded one sent with
    them runs alone and draws exactly what `asample` draws at its seed."""
    path, ref = checkpoints[QWEN], references[QWEN]
    sizes: list[int] = []
    real = completion_run.sample

    def counted(worker: Any, members: list[Any]) -> dict[str, Any]:
        sizes.append(len(members))
        if len(sizes) == 1:
            time.sleep(1.0)  # the others arrive meanwhile and wait together
        return real(worker, members)

    monkeypatch.setattr(completion_run, "sample", counted)
    prompts = [PROMPT, PROMPT[:4], PROMPT[1:]]
    body = {"model": path, "max_tokens": 10, "logprobs": True, "raw_output": True}

    def one(i: int) -> dict[str, Any]:
        with inference(live, "alice") as http:
            if i == 8:
                return complete(http, **{**body, **SAMPLED}, prompt=PROMPT)
            return complete(http, **body, prompt=prompts[i % 3], temperature=1.0)

    with ThreadPoolExecutor(9) as pool:
        outs = list(pool.map(one, range(9)))
    assert sum(sizes) == 9 and max(sizes) > 1, sizes
    for i, out in enumerate(outs[:8]):
        (choice,) = out["choices"]
        prompt, tokens = prompts[i % 3], choice["raw_output"]["completion_token_ids"]
        assert choice["raw_output"]["prompt_token_ids"] == prompt
        logprobs = ref.logprobs(prompt + tokens)
        for j, (token, row) in enumerate(zip(tokens, choice["logprobs"]["content"], strict=True)):
            assert abs(row["logprob"] - logprobs[len(prompt) - 1 + j, token].item()) <= TOL
    with tinker(live, "alice") as http:
        (expected,) = asample(http, path, 1, **SAMPLED)
    assert outs[8]["choices"][0]["raw_output"]["completion_token_ids"] == expected


def test_max_tokens_0_scores_the_prompt(
    live: LiveServer, checkpoints: dict[str, str], references: dict[str, Reference]
) -> None:
    """`max_tokens: 0` with `echo` (docs/semantics.md §25): the prompt's rows alone, as the
    reference scores them, nothing generated (`length`, 0 completion tokens); without echo, or
    streamed, a 400 naming the field."""
    path, ref = checkpoints[QWEN], references[QWEN]
    body = {"model": path, "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": True}
    with inference(live, "alice") as http:
        answer = complete(http, **body, raw_output=True)
        for extra, field in (({"echo": False}, "max_tokens"), ({"stream": True}, "stream")):
            refused = http.post(ROUTE, json={**body, **extra})
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["param"] == field
    (choice,) = answer["choices"]
    assert choice["finish_reason"] == "length"
    assert choice["raw_output"]["completion_token_ids"] == PROMPT
    assert answer["usage"]["completion_tokens"] == 0
    rows = choice["logprobs"]["content"]
    assert [r["token_id"] for r in rows] == PROMPT and rows[0]["logprob"] == 0.0
    logprobs = ref.logprobs(PROMPT)
    for i, row in enumerate(rows[1:], start=1):
        assert abs(row["logprob"] - logprobs[i - 1, PROMPT[i]].item()) <= TOL


def test_the_cookbooks_igpo_scorer_reads_the_reference(
    live: LiveServer,
    checkpoints: dict[str, str],
    references: dict[str, Reference],
    fw_models: dict[str, Path],
    cookbook_py: Path,
    cookbook: Path,
) -> None:
    """The cookbook's IGPO turn scorer (`training/utils/rl/igpo.py`:
    `score_prefix_via_inference`, `max_tokens: 0` with echo), run unchanged in its venv, gets
    the reference's mean log P(answer | prefix)."""

    path, logprobs = checkpoints[QWEN], references[QWEN].logprobs(PROMPT)
    prefix, answer_ids = PROMPT[:4], PROMPT[4:]
    want = sum(logprobs[i - 1, PROMPT[i]].item() for i in range(4, len(PROMPT))) / 2
    script = (
        "import json, sys\n"
        "from transformers import AutoTokenizer\n"
        "from training.utils.rl.igpo import score_prefix_via_inference\n"
        "url, model, key, tok, prefix, answer = sys.argv[1:]\n"
        "tokenizer = AutoTokenizer.from_pretrained(tok)\n"
        "print(json.dumps(score_prefix_via_inference(url, model, key, tokenizer,"
        " json.loads(prefix), json.loads(answer))))\n"
    )
    argv = [f"{live.url}/inference", path, KEYS["alice"], str(fw_models[QWEN])]
    argv += [json.dumps(prefix), json.dumps(answer_ids)]
    got = run_inline(cookbook_py, script, argv, cookbook)
    assert abs(float(got) - want) <= TOL, (got, want)
