"""The Fireworks serverless surface (`/training/v1/serverless`, docs/semantics.md §26).

Through the official SDK, unchanged (`sdk_scripts/serverless_rl.py`, both SDK lines, both
families): a `ts-` session, a run-scoped LoRA model (`run-<32 hex>:train:<seq>`), sampler paths
`<account>/run-<32 hex>/<name>` of that very run, completions on the session's checkpoints whose
logprobs are the trainer's `forward` at the same weights (within 1e-3), the session's base model
(the policy before its first step), importance-sampling steps that lower their batch's
policy-gradient surrogate, a standalone sampler of the last checkpoint, and full parameters
refused. Over raw HTTP: the session on the control plane (its checkpoint rows, promotion, its
deletion), bad input as a 4xx naming the field, and every route of the surface answering
another account's object exactly as a missing one.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.conftest import LiveServer, serve_in_thread
from tests.fireworks.conftest import LLAMA, QWEN, SCRIPTS, run_fw
from tests.fireworks.test_control_plane import KEYS, write_keys

pytestmark = pytest.mark.fireworks

BASE = "/training/v1/serverless"
STEPS = 2
RUN = re.compile(r"^run-[0-9a-f]{32}$")


@pytest.fixture(scope="module")
def live(
    fw_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    ring = write_keys(tmp_path_factory.mktemp("serverless-keys") / "keys.toml")
    storage = tmp_path_factory.mktemp("serverless-storage")
    with serve_in_thread(storage, fw_models, keys=ring) as server:
        yield server


@pytest.fixture(scope="module")
def runs() -> dict[str, dict[str, Any]]:
    """The SDK runs of this module, by model (the HTTP tests read the last one's session)."""
    return {}


def client(live: LiveServer, name: str) -> httpx.Client:
    return httpx.Client(base_url=live.url, headers={"X-Api-Key": KEYS[name]}, timeout=120)


def error(r: httpx.Response) -> dict[str, Any]:
    found: dict[str, Any] = r.json()["error"]
    return found


@pytest.mark.parametrize("model", [pytest.param(QWEN, id="qwen"), pytest.param(LLAMA, id="llama")])
def test_the_sdk_trains_and_samples_on_the_serverless_surface(
    fw_python: Path,
    live: LiveServer,
    fw_models: dict[str, Path],
    runs: dict[str, dict[str, Any]],
    model: str,
) -> None:
    argv = [str(SCRIPTS / "serverless_rl.py"), model, str(fw_models[model]), str(STEPS)]
    out = run_fw(fw_python, live, argv, timeout=600, api_key=KEYS["alice"])
    runs[model] = out

    session, run_id = out["session_id"], out["run_id"]
    assert re.fullmatch(r"ts-[0-9a-f]{32}", session), out
    assert out["session_name"] == f"accounts/alice/trainingSessions/{session}"
    assert RUN.fullmatch(run_id) and out["model_id"].startswith(f"{run_id}:train:"), out
    assert len(out["paths"]) == STEPS and len(set(out["paths"])) == STEPS
    for path in out["paths"]:
        account, run, name = path.split("/")
        assert (account, run) == ("alice", run_id) and name.startswith("step-"), path
    prefix = f"accounts/alice/trainingSessions/{session}/checkpoints/"
    assert out["sampler_models"] == [prefix + p for p in out["paths"]]

    # completions are the trainer's forward at the weights they were sampled from
    assert out["max_gap"] <= 1e-3, out["max_gap"]
    assert out["base_gap"] <= 1e-3, out["base_gap"]
    moved = [(b, a) for b, a in zip(out["loss_before"], out["loss_after"], strict=True) if b]
    assert moved, out
    assert all(a < b for b, a in moved), moved
    if "standalone_model" in out:  # 1.2.30: create_sampling_route, then the sampler
        assert out["standalone_model"] == (
            f"accounts/alice/trainingSamplers/checkpoints/{out['final']}"
        )
        assert out["standalone_gap"] <= 1e-3, out["standalone_gap"]
    assert "lora_config.rank" in out["full_parameter"], out["full_parameter"]
    # resumed by the path save_state returned: the same weights, and the same optimizer (one
    # more step on both agrees, where a fresh optimizer's does not)
    assert out["state"] == f"alice/{run_id}/resume-1", out["state"]
    assert RUN.fullmatch(out["resumed_run"]) and out["resumed_run"] != run_id, out
    assert out["resume_gap"] <= 1e-6, out["resume_gap"]
    assert out["resume_step_gap"] <= 1e-6, out["resume_step_gap"]
    assert out["fresh_optimizer_gap"] > 1e-3, out["fresh_optimizer_gap"]


@pytest.fixture(scope="module")
def sdk_run(
    live: LiveServer,
    fw_python_latest: Path,
    fw_models: dict[str, Path],
    runs: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """The last SDK run of this module; one of its own when none ran yet (pytest groups the
    tests of a session-parametrized fixture, `fw_python`, so the runs above may come later)."""
    if not runs:
        argv = [str(SCRIPTS / "serverless_rl.py"), QWEN, str(fw_models[QWEN]), str(STEPS)]
        runs[QWEN] = run_fw(fw_python_latest, live, argv, timeout=600, api_key=KEYS["alice"])
    return list(runs.values())[-1]


def test_the_session_on_the_control_plane(live: LiveServer, sdk_run: dict[str, Any]) -> None:
    out = sdk_run
    session, run_id = out["session_id"], out["run_id"]
    alice = client(live, "alice")
    listing = alice.get(f"/v1/accounts/alice/trainingSessions/{session}/checkpoints")
    assert listing.status_code == 200, listing.text
    rows = listing.json()["checkpoints"]
    names = [row["name"].rsplit("/", 1)[-1] for row in rows]
    saved = [*out["paths"], out["final"], out["state"]]
    wanted = [f"{run_id}-{p.split('/')[-1]}" for p in saved]
    assert names == wanted, names
    *sampler_rows, state_row = rows
    assert all(r["checkpointType"] == "CHECKPOINT_TYPE_INFERENCE_LORA" for r in sampler_rows)
    assert all(r["promotable"] for r in sampler_rows), rows
    assert state_row["checkpointType"] == "CHECKPOINT_TYPE_TRAINING_LORA", state_row
    assert not state_row["promotable"], state_row
    assert all(r["name"].startswith(f"accounts/alice/trainingSessions/{session}/") for r in rows)

    # a row's name samples too, and promotion serves it as a model of the account
    completion = {"prompt": [10, 11, 12], "max_tokens": 3, "temperature": 0.0, "logprobs": True}
    by_row = alice.post(
        f"{BASE}/inference/v1/completions", json={**completion, "model": sampler_rows[-1]["name"]}
    )
    by_path = alice.post(
        f"{BASE}/inference/v1/completions",
        json={
            **completion,
            "model": f"accounts/alice/trainingSessions/{session}/checkpoints/{out['final']}",
        },
    )
    assert by_row.status_code == by_path.status_code == 200, (by_row.text, by_path.text)
    row_lps = [c["logprob"] for c in by_row.json()["choices"][0]["logprobs"]["content"]]
    path_lps = [c["logprob"] for c in by_path.json()["choices"][0]["logprobs"]["content"]]
    assert row_lps == pytest.approx(path_lps, abs=1e-6)
    model_id = f"sl-{uuid.uuid4().hex[:8]}"
    promoted = alice.post(
        f"/v1/{sampler_rows[-1]['name']}:promote",
        json={"output_model": f"accounts/alice/models/{model_id}", "base_model": QWEN},
    )
    assert promoted.status_code == 200, promoted.text
    model = promoted.json()["model"]
    assert model["kind"] == "HF_PEFT_ADDON", model
    assert model["checkpoint"] == sampler_rows[-1]["name"], model
    again = alice.post(
        f"/v1/{sampler_rows[-1]['name']}:promote",
        json={"output_model": f"accounts/alice/models/{model_id}", "base_model": QWEN},
    )
    assert again.status_code == 409 and error(again)["param"] == "output_model"
    served = alice.post(
        "/inference/v1/completions",
        json={**completion, "model": f"accounts/alice/models/{model_id}"},
    )
    assert served.status_code == 200, served.text
    served_lps = [c["logprob"] for c in served.json()["choices"][0]["logprobs"]["content"]]
    assert served_lps == pytest.approx(path_lps, abs=1e-6)


def test_bad_input_is_a_4xx_naming_the_field(live: LiveServer) -> None:
    alice = client(live, "alice")
    session = alice.post(f"{BASE}/api/v1/create_session", json={}).json()["session_id"]
    assert re.fullmatch(r"ts-[0-9a-f]{32}", session)
    body = {"session_id": session, "model_seq_id": 0, "base_model": QWEN}
    full = alice.post(f"{BASE}/api/v1/create_model", json={**body, "lora_config": {"rank": 0}})
    assert full.status_code == 400 and error(full)["param"] == "lora_config.rank", full.text
    wide = alice.post(f"{BASE}/api/v1/create_model", json={**body, "lora_config": {"rank": 4096}})
    assert wide.status_code == 400 and error(wide)["param"] == "lora_config.rank", wide.text
    unknown = alice.post(f"{BASE}/api/v1/create_model", json={**body, "base_model": "nope"})
    assert unknown.status_code == 400 and error(unknown)["param"] == "base_model"
    tinker = alice.post("/api/v1/create_session", json={}).json()["session_id"]
    plain = alice.post(f"{BASE}/api/v1/create_model", json={**body, "session_id": tinker})
    assert plain.status_code == 400 and error(plain)["param"] == "session_id"
    for route_body, param in (
        ({"training_run": "runs/x"}, "training_run"),
        ({"training_run": "accounts/alice/trainingRuns/run-x"}, "training_run"),
        ({"base_model": "nope"}, "base_model"),
    ):
        r = alice.post(f"{BASE}/api/v1/create_sampling_route", json=route_body)
        assert r.status_code == 400 and error(r)["param"] == param, (route_body, r.text)
    both = alice.post(f"{BASE}/api/v1/create_sampling_route", json={})
    assert both.status_code == 400, both.text
    ok = alice.post(f"{BASE}/api/v1/create_sampling_route", json={"base_model": QWEN})
    assert ok.status_code == 200, ok.text
    nowhere = alice.get(f"{BASE}/v1/accounts")
    assert nowhere.status_code == 404 and error(nowhere)["param"] == "route"
    unauthenticated = httpx.post(f"{live.url}{BASE}/api/v1/create_session", json={})
    assert unauthenticated.status_code == 401


def _masked(r: httpx.Response, *secrets: str) -> tuple[int, str]:
    text = r.text
    for secret in secrets:
        text = text.replace(secret, "<x>")
    return r.status_code, re.sub(r"[0-9a-f]{32}", "<hex>", text)


def test_another_accounts_session_answers_as_a_missing_one(
    live: LiveServer, sdk_run: dict[str, Any]
) -> None:
    out = sdk_run
    session, run_id, path = out["session_id"], out["run_id"], out["paths"][-1]
    missing_session = f"ts-{uuid.uuid4().hex}"
    missing_run = f"run-{uuid.uuid4().hex}"
    bob = client(live, "bob")
    completion = {"prompt": [10, 11], "max_tokens": 2}
    models = [
        (
            f"accounts/alice/trainingSessions/{session}/checkpoints/{path}",
            f"accounts/alice/trainingSessions/{missing_session}/checkpoints/{path}",
        ),
        (
            f"accounts/bob/trainingSessions/{session}/checkpoints/{path}",
            f"accounts/bob/trainingSessions/{missing_session}/checkpoints/{path}",
        ),
        (
            f"accounts/bob/trainingSessions/{session}",
            f"accounts/bob/trainingSessions/{missing_session}",
        ),
        (
            f"accounts/bob/trainingSamplers/checkpoints/{path}",
            f"accounts/bob/trainingSamplers/checkpoints/alice/{missing_run}/step-0",
        ),
        (
            f"accounts/alice/trainingSamplers/checkpoints/{path}",
            f"accounts/alice/trainingSamplers/checkpoints/alice/{missing_run}/step-0",
        ),
    ]
    for theirs, nothing in models:
        a = bob.post(f"{BASE}/inference/v1/completions", json={**completion, "model": theirs})
        b = bob.post(f"{BASE}/inference/v1/completions", json={**completion, "model": nothing})
        assert a.status_code == 404, (theirs, a.text)
        assert _masked(a, theirs) == _masked(b, nothing), (theirs, a.text, b.text)

    def pair(method: str, template: str, **body: Any) -> None:
        def filled(s: str, r: str) -> tuple[str, dict[str, Any]]:
            values = {k: v.format(s=s, r=r) if isinstance(v, str) else v for k, v in body.items()}
            return template.format(s=s, r=r), values

        url, sent = filled(session, run_id)
        a = bob.request(method, url, json=sent)
        url, sent = filled(missing_session, missing_run)
        b = bob.request(method, url, json=sent)
        assert a.status_code == 404, (template, a.text)
        assert _masked(a) == _masked(b), (template, a.text, b.text)

    for account in ("alice", "bob"):
        pair("GET", f"/v1/accounts/{account}/trainingSessions/{{s}}/checkpoints")
        pair("DELETE", f"/v1/accounts/{account}/trainingSessions/{{s}}")
        pair(
            "POST",
            f"/v1/accounts/{account}/trainingSessions/{{s}}/checkpoints/{{r}}-step-0:promote",
            output_model="accounts/bob/models/stolen",
            base_model=QWEN,
        )
        pair(
            "POST",
            f"{BASE}/api/v1/create_sampling_route",
            training_run=f"accounts/{account}/trainingRuns/{{r}}",
        )
    pair("POST", f"{BASE}/api/v1/create_model", session_id="{s}", model_seq_id=0, base_model=QWEN)
    pair("POST", f"{BASE}/api/v1/session_heartbeat", session_id="{s}")
    pair("POST", f"{BASE}/api/v1/optim_step", model_id="{r}:train:0")
    # a saved state's path, described: alice's is to bob what a name never saved is
    state, never = out["state"], f"alice/{missing_run}/resume-1"
    a = bob.post(f"{BASE}/api/v1/weights_info", json={"tinker_path": state})
    b = bob.post(f"{BASE}/api/v1/weights_info", json={"tinker_path": never})
    assert a.status_code == 400 and error(a)["param"] == "tinker_path", a.text
    assert _masked(a, state) == _masked(b, never), (a.text, b.text)
    mine = alice_client = client(live, "alice")
    info = mine.post(f"{BASE}/api/v1/weights_info", json={"tinker_path": state})
    assert info.status_code == 200 and info.json()["base_model"] == out["base_model"], info.text
    assert info.json()["lora_rank"] == 4, info.text
    # alice's session and checkpoints are untouched
    alice = alice_client
    listing = alice.get(f"/v1/accounts/alice/trainingSessions/{session}/checkpoints")
    assert listing.status_code == 200 and listing.json()["checkpoints"], listing.text


def test_deleting_a_session_ends_it_and_keeps_its_checkpoints(
    live: LiveServer, sdk_run: dict[str, Any]
) -> None:
    out = sdk_run
    session = out["session_id"]
    alice = client(live, "alice")
    gone = alice.delete(f"/v1/accounts/alice/trainingSessions/{session}")
    assert gone.status_code == 200, gone.text
    again = alice.delete(f"/v1/accounts/alice/trainingSessions/{session}")
    assert again.status_code == 200, again.text
    beat = alice.post(f"{BASE}/api/v1/session_heartbeat", json={"session_id": session})
    assert beat.status_code == 410, beat.text
    step = alice.post(f"{BASE}/api/v1/optim_step", json={"model_id": out["model_id"]})
    assert step.status_code == 400 and error(step)["param"] == "model_id", step.text
    listing = alice.get(f"/v1/accounts/alice/trainingSessions/{session}/checkpoints")
    assert len(listing.json()["checkpoints"]) == STEPS + 2, listing.text
