"""The completions route's rules: every name kind of `model` (a tinker path, a Fireworks logical
sampler path, an engine checkpoint id, a catalogue model), another account's checkpoint
answering exactly as a missing one, bad fields as 400s naming them, a closed stream stopping
its generation, and the Fireworks SDK's `DeploymentSampler` against a checkpoint name.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.conftest import LiveServer
from tests.fireworks.conftest import QWEN, run_fw
from tests.fireworks.test_completions import (
    PROMPT,
    ROUTE,
    SAMPLED,
    asample,
    checkpoints,  # noqa: F401  (module fixtures, one worker for this module)
    complete,
    inference,
    live,  # noqa: F401
    tinker,
)
from tests.tinker import tinker_http as th
from trainer.api.fireworks.completion_run import engine_error
from trainer.api.fireworks.records import PromotedModel
from trainer.api.tinker.records import TinkerCheckpoint
from trainer.compute.sampler import STOP_CANCELLED
from trainer.serving.catalogue import OP_COMPLETED, OP_FAILED

pytestmark = pytest.mark.fireworks

FIRETITAN = "AsyncTinker/Python 0.23.0"  # the Fireworks SDK's vendored Tinker client


def tokens_of(out: dict[str, Any]) -> list[list[int]]:
    return [c["raw_output"]["completion_token_ids"] for c in out["choices"]]


@pytest.fixture(scope="module")
def promoted(live: LiveServer, checkpoints: dict[str, str]) -> str:  # noqa: F811
    """Alice's LoRA checkpoint as a model of her account, recorded as promotion records it
    (`Catalog.promote`, whose route needs a trainer job: tests/fireworks/
    test_control_plane_checkpoints.py)."""
    saved = live.app.state.tinker.db.get(TinkerCheckpoint, checkpoints[QWEN])
    record = live.worker.checkpoints.get(saved.checkpoint_id)
    model = PromotedModel(
        account="alice",
        id="promoted-1",
        checkpoint_id=record.id,
        checkpoint_name="s-0",
        job_id="none",
        base_model=QWEN,
        lora_rank=int(record.lora_rank),
        created_at=time.time(),
    )
    live.app.state.fireworks.records.insert(model)
    return "accounts/alice/models/promoted-1"


def test_every_kind_of_name_samples_its_weights(
    live: LiveServer,  # noqa: F811
    checkpoints: dict[str, str],  # noqa: F811
    promoted: str,
) -> None:
    path = checkpoints[QWEN]
    saved = live.app.state.tinker.db.get(TinkerCheckpoint, path)
    body = {"prompt": PROMPT, "raw_output": True, **SAMPLED}
    with tinker(live, "alice") as http:
        expected = asample(http, path, 1, **SAMPLED)
        base = http.post(
            "/asample",
            json={
                "base_model": QWEN,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
                "num_samples": 1,
                "sampling_params": SAMPLED,
            },
        )
        base_tokens = [s["tokens"] for s in th.wait(http, base.json()["request_id"])["sequences"]]
    # the Fireworks SDK's own save: a logical sampler path `<account>/run-<32 hex>/<name>`
    with httpx.Client(
        base_url=f"{live.url}{th.PREFIX}",
        headers={"X-API-Key": live_key("alice"), "User-Agent": FIRETITAN},
        timeout=120,
    ) as fw:
        session = th.new_session(fw)
        made = {"session_id": session, "model_seq_id": 0, "base_model": QWEN}
        model_id = th.ok(fw, "/create_model", {**made, "lora_config": {"rank": 2, "seed": 0}})
        logical = th.ok(
            fw, "/save_weights_for_sampler", {"model_id": model_id["model_id"], "path": "fw-1"}
        )["path"]
    assert not logical.startswith("tinker://") and logical.split("/")[2] == "fw-1"
    with inference(live, "alice") as http:
        assert tokens_of(complete(http, model=path, **body)) == expected
        by_id = complete(http, model=saved.checkpoint_id, **body)  # the RL face's name
        assert tokens_of(by_id) == expected
        assert tokens_of(complete(http, model=promoted, **body)) == expected
        assert tokens_of(complete(http, model=QWEN, **body)) == base_tokens
        # a fresh adapter (B = 0) computes the base model exactly
        assert tokens_of(complete(http, model=logical, **body)) == base_tokens
        on_v1 = http.post("/v1/completions", json={"model": path, **body})
        assert on_v1.status_code == 200 and tokens_of(on_v1.json()) == expected


def live_key(user: str) -> str:
    from tests.fireworks.test_completions import KEYS

    return KEYS[user]


CHAT = "/inference/v1/chat/completions"


def test_another_accounts_checkpoint_is_missing(
    live: LiveServer,  # noqa: F811
    checkpoints: dict[str, str],  # noqa: F811
    promoted: str,
) -> None:
    path = checkpoints[QWEN]
    saved = live.app.state.tinker.db.get(TinkerCheckpoint, path)
    run = path.split("/")[2]
    absent = f"tinker://{run}/sampler_weights/never-saved"
    body = {"prompt": PROMPT, "max_tokens": 2}
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    with inference(live, "bob") as bob:
        for theirs, missing in (
            (path, absent),
            (saved.checkpoint_id, "ckpt-never-saved"),
            (promoted, "accounts/bob/models/never-promoted"),
            (promoted, "accounts/alice/models/never-promoted"),
        ):
            for route, asked in ((ROUTE, body), (CHAT, chat)):
                got = bob.post(route, json={"model": theirs, **asked})
                none = bob.post(route, json={"model": missing, **asked})
                assert got.status_code == none.status_code == 404, (got.text, none.text)
                assert got.json() == json.loads(none.text.replace(missing, theirs))
                assert got.json()["error"]["param"] == "model"
    with inference(live, "alice") as alice:
        assert alice.post(ROUTE, json={"model": path, **body}).status_code == 200
    no_key = httpx.post(f"{live.url}{ROUTE}", json={"model": path, **body})
    assert no_key.status_code == 401
    assert httpx.post(f"{live.url}{CHAT}", json={"model": path, **chat}).status_code == 401


def test_a_full_weight_checkpoint_is_refused_naming_model(
    live: LiveServer,  # noqa: F811
) -> None:
    with tinker(live, "alice") as http:
        session = th.new_session(http)
        body = {"session_id": session, "model_seq_id": 0, "base_model": QWEN}
        model_id = th.ok(http, "/create_model", {**body, "lora_config": {"rank": 0}})["model_id"]
        saved = th.ok(http, "/save_weights_for_sampler", {"model_id": model_id, "path": "full"})
        th.ok(http, "/unload_model", {"model_id": model_id})  # its resource: alice's quota
    with inference(live, "alice") as http:
        response = http.post(ROUTE, json={"model": saved["path"], "prompt": PROMPT})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "model" and "full-weight" in error["message"]


BAD: list[tuple[dict[str, Any], str]] = [
    ({"prompt": []}, "prompt"),
    ({"prompt": [[1, 2], [3, 4]]}, "prompt"),
    ({"prompt": [1, -2]}, "prompt[1]"),
    ({"prompt": [1, 999]}, "prompt[1]"),  # outside the vocabulary (the engine's check)
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 100000}, "max_tokens"),  # past the context length
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -3}, "top_k"),
    ({"logprobs": 21}, "logprobs"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"echo": "yes"}, "echo"),
    ({"echo_last": -1}, "echo_last"),
    ({"stop": [1.5]}, "stop[0]"),
    ({"stop": 7}, "stop"),
    ({"seed": "x"}, "seed"),
    ({"stream": 1}, "stream"),
    ({"include_routing_matrix": True}, "include_routing_matrix"),
    ({"top_sampling_logprobs": 4}, "top_sampling_logprobs"),
    ({"routing_matrix_format": "parquet_v1"}, "routing_matrix_format"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"images": ["data:"]}, "images"),
    ({"model": 3}, "model"),
    ({"model": "tinker://nope"}, "model"),
]


def test_bad_fields_are_400s_naming_them(
    live: LiveServer,  # noqa: F811
    checkpoints: dict[str, str],  # noqa: F811
) -> None:
    good = {"model": checkpoints[QWEN], "prompt": PROMPT, "max_tokens": 2}
    with inference(live, "alice") as http:
        for change, field in BAD:
            for streamed in (False, True):
                response = http.post(ROUTE, json={**good, "stream": streamed, **change})
                assert response.status_code == 400, (change, response.text)
                assert response.json()["error"]["param"] == field, (change, response.text)
        harmless = {"prompt_cache_key": "k", "user": "u", "reset_prompt_cache": True}
        assert http.post(ROUTE, json={**good, **harmless}).status_code == 200
        legacy = complete(http, **good, logprobs=2)  # OpenAI legacy: an int k is top-k
        rows = legacy["choices"][0]["logprobs"]["content"]
        assert rows and all(len(row["top_logprobs"]) == 2 for row in rows)
        assert legacy["choices"][0]["logprobs"]["token_logprobs"] == [r["logprob"] for r in rows]
        text = http.post(ROUTE, json={**good, "prompt": "the cat sat", "raw_output": True})
        assert text.status_code == 200, text.text
        assert text.json()["choices"][0]["prompt_token_ids"] == [17, 18, 19]


def test_closing_the_stream_stops_the_generation(
    live: LiveServer,  # noqa: F811
    checkpoints: dict[str, str],  # noqa: F811
) -> None:
    path = checkpoints[QWEN]
    saved = live.app.state.tinker.db.get(TinkerCheckpoint, path)
    body = {"model": path, "prompt": PROMPT, "max_tokens": 400, "stream": True}
    body.update(temperature=1.0, seed=3, stop=[])
    with inference(live, "alice") as http, http.stream("POST", ROUTE, json=body) as response:
        assert response.status_code == 200
        first = next(response.iter_lines())
        completion_id = json.loads(first[len("data: ") :])["id"]
    pool = live.app.state.tinker_samplers
    session_id = pool.open[saved.checkpoint_id]
    key = f"completions:{completion_id}"
    deadline = time.monotonic() + 60
    row = live.worker.store.op_by_key(session_id, key)
    while row is None or row.status not in (OP_COMPLETED, OP_FAILED):
        assert time.monotonic() < deadline, "the generation never ended"
        time.sleep(0.1)
        row = live.worker.store.op_by_key(session_id, key)
    output = dict(row.output or {})
    if "payload_id" in output:
        output.update(live.worker.payloads.read_json(session_id, output.pop("payload_id")))
    assert row.status == OP_COMPLETED, row.error
    (seq,) = output["results"][0]["sequences"]
    assert seq["stop_reason"] == STOP_CANCELLED
    assert len(seq["tokens"]) < 400


SDK_SCRIPT = """
import asyncio, json, os, sys

from fireworks.training.sdk.sampling import DeploymentSampler

model, prompt, params = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
max_tokens, temperature = params.pop("max_tokens"), params.pop("temperature")


def view(c):
    keys = ("full_tokens", "prompt_len", "finish_reason", "inference_logprobs",
            "sampling_logprobs", "logprobs_echoed", "inference_topk_token_ids")
    return {k: getattr(c, k, None) for k in keys}


async def main():
    sampler = DeploymentSampler(
        inference_url=os.environ["FIREWORKS_BASE_URL"],
        model=model,
        api_key=os.environ["FIREWORKS_API_KEY"],
    )
    args = dict(n=1, max_tokens=max_tokens, temperature=temperature, logprobs=True, **params)
    plain = await sampler.sample_with_prompt_tokens(prompt, **args)
    echoed = await sampler.sample_with_prompt_tokens(prompt, echo=True, **args)
    out = {"completions": [view(c) for c in plain], "echoed": [view(c) for c in echoed]}
    print(json.dumps(out))


asyncio.run(main())
"""


def test_fireworks_sdk_samples_a_checkpoint(
    live: LiveServer,  # noqa: F811
    checkpoints: dict[str, str],  # noqa: F811
    fw_python: Path,
    tmp_path: Path,
) -> None:
    """`DeploymentSampler.sample_with_prompt_tokens(..., logprobs=True)`, the SDK unchanged,
    with the checkpoint's name as its `model`: the tokens the Tinker face samples, the
    logprobs aligned (echo: P + C - 1 entries)."""
    path = checkpoints[QWEN]
    params = {"temperature": 0.7, "top_k": 5, "seed": 11, "max_tokens": 8}
    with tinker(live, "alice") as http:
        (expected,) = asample(http, path, 1, **params)
    with inference(live, "alice") as http:
        body = {"model": path, "prompt": PROMPT, "logprobs": True, "raw_output": True}
        (choice,) = complete(http, **body, **params)["choices"]
    script = tmp_path / "completions_sample.py"
    script.write_text(SDK_SCRIPT)
    argv = [str(script), path, json.dumps(PROMPT), json.dumps(params)]
    out = run_fw(fw_python, live, argv, api_key=live_key("alice"))
    (sample,) = out["completions"]
    assert sample["full_tokens"] == PROMPT + expected
    assert sample["prompt_len"] == len(PROMPT)
    rows = choice["logprobs"]["content"]
    assert sample["inference_logprobs"] == [r["logprob"] for r in rows]
    assert sample["sampling_logprobs"] == [r["sampling_logprob"] for r in rows]
    assert sample["finish_reason"] == choice["finish_reason"]
    (echoed,) = out["echoed"]
    assert echoed["full_tokens"] == PROMPT + expected and echoed["logprobs_echoed"]
    assert len(echoed["inference_logprobs"]) == len(PROMPT) + len(expected) - 1
    assert echoed["inference_logprobs"][-len(expected) :] == sample["inference_logprobs"]


def test_engine_failures_answer_by_their_code() -> None:
    """The sample operation's error code decides the completion's status (one request's
    failure, never the route's)."""
    cases = {
        "INVALID_INPUT": 400,
        "NON_FINITE_LOSS": 422,
        "SESSION_NOT_ACTIVE": 503,
        "INTERNAL": 500,
    }
    for code, status in cases.items():
        error = engine_error({"code": code, "message": "sampling_params.max_tokens: too many"})
        assert error.status == status, code
    named = engine_error({"code": "INVALID_INPUT", "message": "m", "param": "model_inputs[0]"})
    assert named.param == "prompt"
