"""The Firetitan data plane's rules over raw HTTP, as the Fireworks SDK's client sends them
(its `User-Agent`, `X-API-Key`): two users, checkpoint names, `load_adapter`, frozen
references, `grad_accumulation_normalization`, chunks of 1,024 datums and forward inputs.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from peft import LoraConfig, get_peft_model
from starlette.testclient import TestClient
from transformers import AutoModelForCausalLM

from tests.api.conftest import LiveServer, serve_in_thread
from tests.api.team_helpers import write_keys
from tests.fireworks.conftest import QWEN
from tests.tinker import tinker_http as th
from trainer.api.keys import KeyRing
from trainer.api.tinker import names
from trainer.api.tinker.binding import SCOPE_KEY, Binding
from trainer.api.tinker.records import TinkerModel
from trainer.contract.specs import ResourceSpec
from trainer.serving.catalogue import RES_READY, RES_STOPPED
from trainer.serving.tenants import Principal

pytestmark = pytest.mark.fireworks

KEYS: dict[str, str] = {}  # user -> key, written by `live`
AGENT = "AsyncTinker/Python 0.23.0"  # the Fireworks SDK's vendored client
SEQ = [3, 17, 22, 9, 27, 5]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("adapters")


@pytest.fixture(scope="module")
def live(
    fw_models: dict[str, Path], adapters: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    KEYS.update(write_keys(path, (), ("alice", "bob")))
    storage = tmp_path_factory.mktemp("fw-dp-storage")
    models = {QWEN: fw_models[QWEN]}
    with serve_in_thread(
        storage, models, keys=KeyRing(path), resume_roots=[str(adapters)]
    ) as server:
        yield server


def user(live: LiveServer, name: str) -> httpx.Client:
    headers = {"X-API-Key": KEYS[name], "User-Agent": AGENT}
    return httpx.Client(base_url=f"{live.url}{th.PREFIX}", headers=headers, timeout=120)


@pytest.fixture(scope="module")
def alice(live: LiveServer) -> Iterator[httpx.Client]:
    with user(live, "alice") as http:
        yield http


@pytest.fixture(scope="module")
def bob(live: LiveServer) -> Iterator[httpx.Client]:
    with user(live, "bob") as http:
        yield http


def model(http: httpx.Client, **body: Any) -> str:
    session = th.new_session(http)
    body = {"session_id": session, "model_seq_id": 0, "base_model": QWEN, **body}
    model_id: str = th.ok(http, "/create_model", body)["model_id"]
    return model_id


def datum(tokens: list[int] = SEQ, **extra: list[float]) -> dict[str, Any]:
    d = th.datum(tokens)
    for name, values in extra.items():
        d["loss_fn_inputs"][name] = th.tensor(values, "float32")
    return d


def forward(http: httpx.Client, model_id: str, data: list[dict[str, Any]]) -> dict[str, Any]:
    body = {"model_id": model_id, "forward_input": {"data": data, "loss_fn": "cross_entropy"}}
    return th.ok(http, "/forward", body)


def error(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    err: dict[str, Any] = response.json()["error"]
    return err


# -- forward, losses, chunks ----------------------------------------------------------------


def test_forward_ignores_inputs_its_loss_does_not_read_and_a_backward_refuses_them(
    alice: httpx.Client,
) -> None:
    m = model(alice, lora_config={"rank": 2, "seed": 0})
    n = len(SEQ) - 1
    extra = {"loss_mask": [1.0] * n, "advantages": [0.5] * n}
    plain = forward(alice, m, [datum()])
    assert forward(alice, m, [datum(**extra)]) == plain
    body = {
        "model_id": m,
        "forward_backward_input": {"data": [datum(**extra)], "loss_fn": "cross_entropy"},
    }
    err = error(alice.post("/forward_backward", json=body))
    assert err["param"].startswith("forward_backward_input.data[0].loss_fn_inputs."), err


@pytest.mark.parametrize("loss", ["dapo", "reinforce", "nope"])
def test_a_loss_without_semantics_here_is_a_400_naming_loss_fn(
    alice: httpx.Client, loss: str
) -> None:
    m = model(alice, lora_config={"rank": 2, "seed": 0})
    body = {"model_id": m, "forward_input": {"data": [datum()], "loss_fn": loss}}
    err = error(alice.post("/forward", json=body))
    assert err["param"] == "forward_input.loss_fn", err
    assert "served:" in err["message"] and "dppo" in err["message"], err


def test_a_chunk_of_1024_datums_is_one_call(alice: httpx.Client, live: LiveServer) -> None:
    entry = live.worker.config.model(QWEN)
    assert entry is not None and entry.max_batch_size < 1024
    m = model(alice, lora_config={"rank": 2, "seed": 0})
    out = forward(alice, m, [datum([3, 4, 5])] * 1024)
    assert len(out["loss_fn_outputs"]) == 1024
    too_many = {
        "model_id": m,
        "forward_input": {"data": [datum([3, 4])] * 1025, "loss_fn": "cross_entropy"},
    }
    assert "1024" in error(alice.post("/forward", json=too_many))["message"]


# -- grad_accumulation_normalization ----------------------------------------------------------


def _grad_norm(http: httpx.Client, normalization: str | None) -> float:
    """Two forward_backward calls (one sequence each) then an optim_step, from the same seed."""
    m = model(http, lora_config={"rank": 2, "seed": 3})
    for tokens in (SEQ, SEQ[:4]):
        body = {
            "model_id": m,
            "forward_backward_input": {"data": [datum(tokens)], "loss_fn": "cross_entropy"},
        }
        th.ok(http, "/forward_backward", body)
    step = th.optim_body(m)
    if normalization is not None:
        step["grad_accumulation_normalization"] = normalization
    return float(th.ok(http, "/optim_step", step)["metrics"]["grad_norm"])


def test_grad_accumulation_normalization_divides_the_accumulated_gradient(
    alice: httpx.Client,
) -> None:
    raw = _grad_norm(alice, None)
    tokens = (len(SEQ) - 1) + 3  # the loss tokens of both calls
    assert _grad_norm(alice, "none") == raw
    assert _grad_norm(alice, "num_sequences") == pytest.approx(raw / 2, rel=1e-5)
    assert _grad_norm(alice, "num_loss_tokens") == pytest.approx(raw / tokens, rel=1e-5)
    m = model(alice, lora_config={"rank": 2, "seed": 0})
    err = error(
        alice.post(
            "/optim_step", json={**th.optim_body(m), "grad_accumulation_normalization": "mean"}
        )
    )
    assert err["param"] == "grad_accumulation_normalization", err


# -- frozen references ------------------------------------------------------------------------


def test_a_base_only_model_is_the_base_model_and_frozen(alice: httpx.Client) -> None:
    base = model(alice, base_only=True)
    info = alice.post("/get_info", json={"model_id": base}).json()
    assert info["is_lora"] is False and info["lora_rank"] == 0 and info["frozen"] is True
    lora = model(alice, lora_config={"rank": 2, "seed": 0})  # B = 0: the base model too
    assert forward(alice, base, [datum()]) == forward(alice, lora, [datum()])
    fb = {
        "model_id": base,
        "forward_backward_input": {"data": [datum()], "loss_fn": "cross_entropy"},
    }
    for path, body in (
        ("/forward_backward", fb),
        ("/optim_step", th.optim_body(base)),
        ("/save_weights", {"model_id": base, "path": "step-1"}),
        ("/save_weights_for_sampler", {"model_id": base, "path": "s-1"}),
    ):
        err = error(alice.post(path, json=body))
        assert err["param"] == "model_id" and "frozen reference" in err["message"], (path, err)
    err = error(
        alice.post(
            "/create_model",
            json={
                "session_id": th.new_session(alice),
                "model_seq_id": 0,
                "base_model": QWEN,
                "base_only": True,
                "lora_config": {"rank": 2},
            },
        )
    )
    assert err["param"] == "lora_config", err


def test_lora_alpha_is_honoured(alice: httpx.Client) -> None:
    """The same seed and step, alpha 8 against alpha 64: the adapters scale differently, so
    the logprobs after one step differ (the LORA_ALPHA constant is not forced)."""
    after = []
    for alpha in (8, 64):
        m = model(alice, lora_config={"rank": 2, "seed": 0, "alpha": alpha})
        fb = {
            "model_id": m,
            "forward_backward_input": {"data": [datum()], "loss_fn": "cross_entropy"},
        }
        th.ok(alice, "/forward_backward", fb)
        th.ok(alice, "/optim_step", th.optim_body(m))
        after.append(th.logprobs(forward(alice, m, [datum()])))
    assert after[0] != after[1]


# -- names across users -----------------------------------------------------------------------


def _same(a: dict[str, Any], b: dict[str, Any], refs: tuple[str, str]) -> None:
    assert a["param"] == b["param"], (a, b)
    assert a["message"].replace(refs[0], "<ref>") == b["message"].replace(refs[1], "<ref>"), (a, b)


def test_checkpoint_names_resolve_for_their_account_only(
    alice: httpx.Client, bob: httpx.Client
) -> None:
    mine = model(alice, lora_config={"rank": 2, "seed": 0})
    saved = th.ok(alice, "/save_weights", {"model_id": mine, "path": "step-1"})["path"]
    assert re.fullmatch(r"alice/run-[0-9a-f]{32}/step-1", saved), saved
    assert saved in alice.get("/list_checkpoints").json()["checkpoints"]
    assert saved not in bob.get("/list_checkpoints").json()["checkpoints"]
    # alice loads it by its path, and by its bare name into the model that saved it
    th.ok(alice, "/load_weights", {"model_id": mine, "path": saved, "optimizer": True})
    th.ok(alice, "/load_weights", {"model_id": mine, "path": "step-1", "optimizer": False})
    # bob: alice's path, a cross-job ref and a bare name answer as names never saved
    theirs = model(bob, lora_config={"rank": 2, "seed": 0})
    missing = saved.replace("alice/", "bob/").replace("step-1", "step-9")
    for ref, gone in (
        (saved, missing),
        ("cross_job://job-a/step-1", "cross_job://job-b/step-9"),
        ("step-1", "step-9"),
    ):
        a = error(
            bob.post("/load_weights", json={"model_id": theirs, "path": ref, "optimizer": False})
        )
        b = error(
            bob.post("/load_weights", json={"model_id": theirs, "path": gone, "optimizer": False})
        )
        _same(a, b, (ref, gone))
    # alice's model is bob's missing model
    a = bob.post(
        "/forward",
        json={"model_id": mine, "forward_input": {"data": [datum()], "loss_fn": "cross_entropy"}},
    )
    gone_id = mine.replace(mine.split(":")[0], "session_" + "0" * 32)
    b = bob.post(
        "/forward",
        json={
            "model_id": gone_id,
            "forward_input": {"data": [datum()], "loss_fn": "cross_entropy"},
        },
    )
    assert a.status_code == b.status_code == 404
    assert a.json()["error"]["message"].replace(mine, "<id>") == b.json()["error"][
        "message"
    ].replace(gone_id, "<id>")
    # a tinker:// path still answers to the Tinker SDK, and is still loadable
    tinker = th.ok(
        alice,
        "/save_weights",
        {"model_id": mine, "path": "step-2"},
        **{"User-Agent": "AsyncTinker/Python 0.38.0"},
    )["path"]
    assert tinker.startswith("tinker://"), tinker
    th.ok(alice, "/load_weights", {"model_id": mine, "path": tinker, "optimizer": True})
    err = error(alice.post("/save_weights", json={"model_id": mine, "path": "Step_3"}))
    assert err["param"] == "path", err


# -- load_adapter -----------------------------------------------------------------------------


def _peft_adapter(base_dir: Path, out: Path) -> Any:
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=2, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    peft_model = get_peft_model(base, config).eval()
    peft_model.save_pretrained(out)
    return peft_model


def test_load_adapter_sets_the_weights_peft_computes(
    alice: httpx.Client,
    bob: httpx.Client,
    live: LiveServer,
    fw_models: dict[str, Path],
    adapters: Path,
) -> None:
    peft_model = _peft_adapter(fw_models[QWEN], adapters / "a1")
    with torch.no_grad():
        logits = peft_model(input_ids=torch.tensor([SEQ[:-1]])).logits[0]
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(SEQ[1:])[:, None])[:, 0]
    m = model(alice, lora_config={"rank": 4, "seed": 0})
    th.ok(
        alice, "/load_adapter", {"model_id": m, "adapter_path": str(adapters / "a1"), "seq_id": 1}
    )
    got = th.logprobs(forward(alice, m, [datum()]))
    assert got == pytest.approx(expected.tolist(), abs=2e-4), (got, expected.tolist())
    # a promoted model name, through the bridge's resolvers: its owner's only
    name = "accounts/alice/models/m1"

    def resolver(text: str, who: Principal) -> Path | None:
        return adapters / "a1" if text == name and who.user == "alice" else None

    live.app.state.tinker.model_resolvers.append(resolver)
    other = model(alice, lora_config={"rank": 2, "seed": 0})
    th.ok(alice, "/load_adapter", {"model_id": other, "adapter_path": name})
    assert th.logprobs(forward(alice, other, [datum()])) == got
    theirs = model(bob, lora_config={"rank": 2, "seed": 0})
    a = error(bob.post("/load_adapter", json={"model_id": theirs, "adapter_path": name}))
    gone = "accounts/alice/models/m9"
    b = error(bob.post("/load_adapter", json={"model_id": theirs, "adapter_path": gone}))
    _same(a, b, (name, gone))
    outside = error(alice.post("/load_adapter", json={"model_id": m, "adapter_path": "/etc"}))
    assert outside["param"] == "adapter_path", outside


# -- bound requests (a gateway's Binding in the ASGI scope) ---------------------------------


def _job(live: LiveServer, name: str, rank: int, forward_only: bool = False) -> Binding:
    """A job's resource of alice's, as the control plane makes it, and its binding."""
    who = live.worker.principals("alice") or Principal("alice")
    spec = ResourceSpec(base_model=QWEN, lora_enabled=rank > 0, inactive_timeout=600)
    resource = live.worker.create_resource(spec, who=who)
    loaded = live.worker.resource_loaded(resource.id)
    if loaded is not None:
        loaded.result(timeout=120)
    return Binding("alice", name, resource.id, QWEN, rank, forward_only)


def bound(live: LiveServer, binding: Binding) -> TestClient:
    """Alice's client on the Tinker routes with `binding` in each request's scope."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope = {**scope, SCOPE_KEY: binding}
        await live.app(scope, receive, send)

    headers = {"X-API-Key": KEYS["alice"], "User-Agent": AGENT}
    return TestClient(app, base_url=f"http://testserver{th.PREFIX}", headers=headers)


def test_a_bound_model_trains_on_its_job_and_names_resolve_across_jobs(live: LiveServer) -> None:
    job_a, job_b = _job(live, "job-a", 0), _job(live, "job-b", 0)
    http_a, http_b = bound(live, job_a), bound(live, job_b)
    full = model(http_a, lora_config={"rank": 0})
    state = live.app.state.tinker.db.get(TinkerModel, full)
    assert state.resource_id == job_a.resource_id and state.scope == job_a.scope
    err = error(
        http_a.post(
            "/create_model",
            json={
                "session_id": th.new_session(http_a),
                "model_seq_id": 1,
                "base_model": QWEN,
                "lora_config": {"rank": 2},
            },
        )
    )
    assert err["param"] == "lora_config.rank", err
    fb = {
        "model_id": full,
        "forward_backward_input": {"data": [datum()], "loss_fn": "cross_entropy"},
    }
    th.ok(http_a, "/forward_backward", fb)
    th.ok(http_a, "/optim_step", th.optim_body(full))
    saved = th.ok(http_a, "/save_weights", {"model_id": full, "path": "step-1"})["path"]
    assert saved == names.canonical("alice", job_a.scope, "step-1")
    assert http_a.get("/list_checkpoints").json() == {"checkpoints": ["step-1"]}
    assert http_b.get("/list_checkpoints").json() == {"checkpoints": []}
    trained = th.logprobs(forward(http_a, full, [datum()]))
    # job b (its own full-weight resource) loads job a's state by its cross-job name
    session_b = th.new_session(http_b)
    loaded = th.ok(
        http_b,
        "/load_weights",
        {
            "session_id": session_b,
            "model_seq_id": 0,
            "path": "cross_job://job-a/step-1",
            "optimizer": True,
        },
    )
    assert th.logprobs(forward(http_b, loaded["model_id"], [datum()])) == trained
    # a forward-only job's models are frozen references
    ref = _job(live, "job-ref", 4, forward_only=True)
    http_r = bound(live, ref)
    frozen = model(http_r, lora_config={"rank": 4, "seed": 0})
    forward(http_r, frozen, [datum()])
    err = error(http_r.post("/forward_backward", json={**fb, "model_id": frozen}))
    assert err["param"] == "model_id" and "frozen reference" in err["message"], err


def test_sampler_checkpoint_types_are_stored_whole(alice: httpx.Client, live: LiveServer) -> None:
    m = model(alice, lora_config={"rank": 2, "seed": 0})
    checkpoints = len(live.worker.checkpoints.list(limit=1 << 20))
    # merged_base of an adapter still zero would be the base model itself: a user error,
    # as the SDK documents, and nothing saved
    fresh = {"model_id": m, "path": "s-fresh", "checkpoint_type": "merged_base"}
    response = alice.post("/save_weights_for_sampler", json=fresh)
    assert response.status_code == 200, response.text
    failed = th.wait(alice, response.json()["request_id"])
    assert "checkpoint_type" in failed["error"] and "still zero" in failed["error"], failed
    assert failed["category"] == "user", failed
    assert len(live.worker.checkpoints.list(limit=1 << 20)) == checkpoints
    fb = {"model_id": m, "forward_backward_input": {"data": [datum()], "loss_fn": "cross_entropy"}}
    th.ok(alice, "/forward_backward", fb)
    th.ok(alice, "/optim_step", th.optim_body(m))
    for kind in ("base", "delta", "merged_base"):
        body = {"model_id": m, "path": f"s-{kind.replace('_', '-')}", "checkpoint_type": kind}
        out = th.ok(alice, "/save_weights_for_sampler", body)
        assert out["checkpoint_type"] == kind and out["stored_as"] == "whole", out
    body = {
        "model_id": m,
        "path": "s-x",
        "checkpoint_type": "merged_base",
        "export_precision": "nvfp4",
    }
    assert error(alice.post("/save_weights_for_sampler", json=body))["param"] == "export_precision"


def test_an_unloaded_full_weight_model_frees_its_resource(
    alice: httpx.Client, live: LiveServer
) -> None:
    full = model(alice, lora_config={"rank": 0})
    state = live.app.state.tinker.db.get(TinkerModel, full)
    assert live.worker.resource(state.resource_id).status == RES_READY
    assert alice.post("/get_info", json={"model_id": full}).json()["is_lora"] is False
    th.ok(alice, "/unload_model", {"model_id": full})
    assert live.worker.resource(state.resource_id).status == RES_STOPPED


def test_a_name_saved_again_is_replaced_and_a_new_model_takes_over_a_full_job(
    live: LiveServer,
) -> None:
    """The cookbook saves `step-2` twice (its interval save, then its final save) and never
    sends `overwrite`: the second save replaces the first. A kept full-weight job's model from
    an earlier run (a client that exited) gives way to the next run's model."""
    job = _job(live, "job-again", 0)
    http = bound(live, job)
    first = model(http, lora_config={"rank": 0})
    save = {"model_id": first, "path": "step-2"}
    before = th.logprobs(forward(http, first, [datum()]))
    th.ok(http, "/save_weights", save)
    fb = {
        "model_id": first,
        "forward_backward_input": {"data": [datum()], "loss_fn": "cross_entropy"},
    }
    th.ok(http, "/forward_backward", fb)
    th.ok(http, "/optim_step", th.optim_body(first))
    after = th.logprobs(forward(http, first, [datum()]))
    assert after != before
    again = th.ok(http, "/save_weights", save)["path"]
    assert again == names.canonical("alice", job.scope, "step-2")
    assert http.get("/list_checkpoints").json() == {"checkpoints": ["step-2"]}
    # the next run's model on the same job: the first model gives way, the name loads the newer
    session = th.new_session(http)
    body = {"session_id": session, "model_seq_id": 0, "path": "step-2", "optimizer": True}
    loaded = th.ok(http, "/load_weights", body)["model_id"]
    assert th.logprobs(forward(http, loaded, [datum()])) == after
    gone = http.post(
        "/forward", json={"model_id": first, "forward_input": fb["forward_backward_input"]}
    )
    assert gone.status_code == 400 and gone.json()["error"]["param"] == "model_id", gone.text
    # the tinker SDK's own rule is unchanged: an existing tinker:// path needs overwrite
    with th.client(live, **{"X-API-Key": f"tml-{KEYS['alice']}"}) as tk:
        tinker_model = model(tk, lora_config={"rank": 2, "seed": 0})
        th.ok(tk, "/save_weights", {"model_id": tinker_model, "path": "twice"})
        refused = tk.post("/save_weights", json={"model_id": tinker_model, "path": "twice"})
        assert "exists" in th.wait(tk, refused.json()["request_id"])["error"]
