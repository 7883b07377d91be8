"""R3, rollout routing replay (docs/semantics.md §12, §25), on a tiny Qwen3-MoE over the wire
as the Fireworks SDK speaks it: completions with `include_routing_matrix` answer each token's
experts (`base64_inline`), which equal the router's top-k of a plain transformers eager forward
of prompt + completion; a datum's `model_input.routing_matrices` (aligned as the cookbook's
`build_r3_routing_matrices` aligns them) forces those experts in the trainer's forward, equal to
the plain-torch forced forward of `tests/engine/test_routing_replay.py` after steps that flip
routes; bad matrices are refused naming the field. Then the same through the SDK itself
(`sdk_scripts/r3.py`: its `DeploymentSampler` and `FiretitanServiceClient`, unchanged).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.api.conftest import LiveServer, serve_in_thread
from tests.api.team_helpers import write_keys
from tests.engine.test_routing_replay import reference
from tests.fireworks.conftest import QWEN, SCRIPTS, run_fw
from tests.tinker import tinker_http as th
from tests.tinker.conftest import build_served_model
from trainer.api.keys import KeyRing
from trainer.api.tinker.records import TinkerModel

pytestmark = pytest.mark.fireworks

MOE = "accounts/fireworks/models/qwen3-moe-tiny"
KEYS: dict[str, str] = {}
PROMPT = [3, 17, 22, 9, 27, 5]
ROUTE = "/inference/v1/completions"
LAYERS, TOP_K, EXPERTS = 2, 2, 4


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("moe-model")
    return build_served_model(where, scale=8.0, seed=5, tokenizer_dir=where, arch="qwen3_moe")


@pytest.fixture(scope="module")
def live(
    moe_dir: Path, fw_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    KEYS.update(write_keys(path, (), ("alice",)))
    storage = tmp_path_factory.mktemp("r3-storage")
    models = {MOE: moe_dir, QWEN: fw_models[QWEN]}
    with serve_in_thread(storage, models, keys=KeyRing(path)) as server:
        yield server


@pytest.fixture(scope="module")
def tinker(live: LiveServer) -> Iterator[httpx.Client]:
    headers = {"X-API-Key": KEYS["alice"], "User-Agent": "AsyncTinker/Python 0.23.0"}
    with httpx.Client(base_url=f"{live.url}{th.PREFIX}", headers=headers, timeout=120) as http:
        yield http


@pytest.fixture(scope="module")
def inference(live: LiveServer) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {KEYS['alice']}"}
    with httpx.Client(base_url=live.url, headers=headers, timeout=120) as http:
        yield http


def decode(matrix: str) -> list[list[int]]:
    raw = base64.b64decode(matrix)  # the documented layout: uint8 [moe layers, active experts]
    assert len(raw) == LAYERS * TOP_K
    return [sorted(raw[i * TOP_K : (i + 1) * TOP_K]) for i in range(LAYERS)]


@torch.no_grad()
def router_top_k(model_dir: Path, tokens: list[int]) -> list[list[list[int]]]:
    """Per position, per MoE layer, the sorted top-k experts of a plain eager forward."""
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    out = model(input_ids=torch.tensor([tokens]), output_router_logits=True)
    per_layer = [logits.softmax(-1).topk(TOP_K, -1).indices for logits in out.router_logits]
    ids = torch.stack(per_layer, 1).sort(-1).values  # [T, layers, k]
    return ids.tolist()


def complete(http: httpx.Client, **body: Any) -> dict[str, Any]:
    request = {"model": MOE, "prompt": PROMPT, "max_tokens": 6, "logprobs": True, **body}
    response = http.post(ROUTE, json=request)
    assert response.status_code == 200, response.text
    if not body.get("stream"):
        out: dict[str, Any] = response.json()
        return out
    chunks = [
        json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")
    ]
    return {"choices": [c for chunk in chunks for c in chunk["choices"] if c.get("logprobs")]}


def rows(out: dict[str, Any]) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = out["choices"][0]["logprobs"]["content"]
    return content


def completion_tokens(out: dict[str, Any], echo: bool) -> list[int]:
    ids = [r["token_id"] for r in rows(out)]
    return ids[len(PROMPT) :] if echo else ids


@pytest.mark.parametrize("stream", [False, True])
def test_completion_matrices_are_the_routers_top_k(
    inference: httpx.Client, moe_dir: Path, stream: bool
) -> None:
    plain = complete(inference, include_routing_matrix=True, seed=4, stream=stream)
    echoed = complete(inference, include_routing_matrix=True, seed=4, echo=True, stream=stream)
    made = completion_tokens(plain, echo=False)
    assert completion_tokens(echoed, echo=True) == made  # the same seed, the same draws
    tokens = PROMPT + made
    expected = router_top_k(moe_dir, tokens)
    # row t carries the routes of the forward that scored it: position t - 1
    assert [decode(r["routing_matrix"]) for r in rows(plain)] == expected[len(PROMPT) - 1 : -1]
    echo_rows = rows(echoed)
    assert echo_rows[0]["routing_matrix"] == ""  # the first prompt token has no forward
    assert [decode(r["routing_matrix"]) for r in echo_rows[1:]] == expected[:-1]
    last = complete(inference, include_routing_matrix=True, seed=4, echo_last=2)
    assert [decode(r["routing_matrix"]) for r in rows(last)] == expected[len(PROMPT) - 3 : -1]
    without = complete(inference, seed=4)
    assert all("routing_matrix" not in r for r in rows(without))


def test_completions_refuse_what_has_no_routes(inference: httpx.Client) -> None:
    for body, field in [
        ({"include_routing_matrix": True, "logprobs": False}, "include_routing_matrix"),
        ({"include_routing_matrix": True, "model": QWEN}, "include_routing_matrix"),  # dense
        ({"routing_matrix_format": "parquet_v1"}, "routing_matrix_format"),
    ]:
        request = {"model": MOE, "prompt": PROMPT, "max_tokens": 2, "logprobs": True, **body}
        response = inference.post(ROUTE, json=request)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == field, response.text


def create_model(http: httpx.Client, base: str, rank: int) -> tuple[str, dict[str, Any]]:
    session = th.new_session(http)
    lora = {"rank": rank, "seed": 0} if rank else {"rank": 0}
    body = {"session_id": session, "model_seq_id": 0, "base_model": base, "lora_config": lora}
    result = th.ok(http, "/create_model", body)
    return str(result["model_id"]), result


def datum(tokens: list[int], matrices: list[str] | None) -> dict[str, Any]:
    d = th.datum(tokens)
    if matrices is not None:
        d["model_input"]["routing_matrices"] = matrices
    return d


def forward(http: httpx.Client, model_id: str, data: list[dict[str, Any]]) -> list[torch.Tensor]:
    body = {"model_id": model_id, "forward_input": {"data": data, "loss_fn": "cross_entropy"}}
    out = th.ok(http, "/forward", body)
    return [torch.tensor(o["logprobs"]["data"]) for o in out["loss_fn_outputs"]]


def aligned(echoed: dict[str, Any], plain: dict[str, Any]) -> dict[str, list[str]]:
    """The training datum's matrices, as the cookbook builds them from a completion: echoed
    (all but the unconditional first row), or completion-only (prompt positions blank)."""
    full = [r["routing_matrix"] for r in rows(echoed)][1:]
    tail = [""] * (len(PROMPT) - 1) + [r["routing_matrix"] for r in rows(plain)]
    return {"full": full, "completion_only": tail}


def test_forward_replays_the_matrices(
    live: LiveServer, tinker: httpx.Client, inference: httpx.Client
) -> None:
    model_id, created = create_model(tinker, MOE, 0)
    assert created["supports_router_replay"] is True
    assert created["routing_matrix_format"] == "base64_inline"
    assert create_model(tinker, QWEN, 2)[1]["supports_router_replay"] is False
    plain = complete(inference, include_routing_matrix=True, seed=9, max_tokens=8)
    echoed = complete(inference, include_routing_matrix=True, seed=9, max_tokens=8, echo=True)
    tokens = PROMPT + completion_tokens(plain, echo=False)
    matrices = aligned(echoed, plain)
    sampled = torch.tensor([r["logprob"] for r in rows(plain)])
    at_sampling = forward(tinker, model_id, [datum(tokens, m) for m in matrices.values()])
    for lp in at_sampling:  # the trainer's forward at the sampling weights: the sampler's
        torch.testing.assert_close(lp[len(PROMPT) - 1 :], sampled, atol=1e-4, rtol=0)

    plain_datum = datum(tokens, None)
    step = {"model_id": model_id, "forward_backward_input": {"data": [plain_datum] * 2}}
    step["forward_backward_input"]["loss_fn"] = "cross_entropy"
    for _ in range(3):  # large steps on every weight, routers included: routes flip
        th.ok(tinker, "/forward_backward", step)
        th.ok(tinker, "/optim_step", th.optim_body(model_id, lr=0.05))
    session = th.engine_session(live, model_id)
    w = {n: t.detach().clone().float() for n, t in session.policy.model.state_dict().items()}
    config = session.policy.model.config
    full_ids = torch.tensor(
        [[list(base64.b64decode(m))[i * 2 : i * 2 + 2] for i in range(2)] for m in matrices["full"]]
    )
    targets = torch.tensor(tokens[1:])

    def ref(forced: torch.Tensor | None) -> torch.Tensor:
        lp, _ = reference(w, config, tokens[:-1], forced)
        return lp.gather(-1, targets[:, None]).squeeze(-1)

    replayed, free = forward(tinker, model_id, [datum(tokens, matrices["full"]), plain_datum])
    torch.testing.assert_close(replayed, ref(full_ids), atol=1e-5, rtol=0)
    torch.testing.assert_close(free, ref(None), atol=1e-5, rtol=0)
    own = reference(w, config, tokens[:-1], None)[1]
    flips = (own.sort(-1).values != full_ids.sort(-1).values).any(-1).any(-1)
    assert bool(flips.any()), "the steps moved no route: the heavy case did not happen"
    assert (replayed - free).abs().max() > 1e-4
    tail = forward(tinker, model_id, [datum(tokens, matrices["completion_only"])])[0]
    mixed = full_ids.clone()
    mixed[: len(PROMPT) - 1] = own[: len(PROMPT) - 1]  # the prompt on the router's own choice
    torch.testing.assert_close(tail, ref(mixed), atol=1e-5, rtol=0)


def test_bad_matrices_are_refused_naming_the_field(tinker: httpx.Client) -> None:
    model_id, _ = create_model(tinker, MOE, 2)
    tokens = [*PROMPT, 11, 12]
    good = [base64.b64encode(bytes([0, 1, 2, 3])).decode()] * (len(tokens) - 1)
    field = "forward_input.data[0].model_input"

    def post(model_input_change: dict[str, Any]) -> httpx.Response:
        d = datum(tokens, good)
        d["model_input"].update(model_input_change)
        body = {"model_id": model_id, "forward_input": {"data": [d], "loss_fn": "cross_entropy"}}
        return tinker.post("/forward", json=body)

    for change, param in [
        ({"routing_matrices": good[:-1]}, f"{field}.routing_matrices"),  # one fewer
        ({"routing_matrices": [1] * len(good)}, f"{field}.routing_matrices"),
        ({"routing_matrix_format": "parquet_v1"}, f"{field}.routing_matrix_format"),
    ]:
        response = post(change)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param, response.text
    for bad, why in [
        (bytes([0, 1, 2]), "3 bytes"),  # not 2 layers x top-2
        (bytes([0, 1, 2, 4]), "out of range"),  # expert 4 of 4
    ]:
        matrices = list(good)
        matrices[3] = base64.b64encode(bad).decode()
        response = post({"routing_matrices": matrices})
        assert response.status_code == 200, response.text
        failed = th.wait(tinker, response.json()["request_id"])
        assert "INVALID_INPUT" in failed["error"] and why in failed["error"], failed
        assert ".data[0].model_input.routing_matrices[3]" in failed["error"], failed
    assert forward(tinker, model_id, [datum(tokens, good)])  # and a good one still runs


def test_the_sdk_samples_matrices_and_trains_on_them(
    fw_python_latest: Path, live: LiveServer, moe_dir: Path
) -> None:
    before_run = {m.id for m in live.app.state.tinker.db.select(TinkerModel)}
    out = run_fw(
        fw_python_latest,
        live,
        [str(SCRIPTS / "r3.py"), MOE, json.dumps(PROMPT)],
        api_key=KEYS["alice"],
    )
    assert out["supports_router_replay"] is True
    assert out["routing_matrix_format"] == "base64_inline"
    tokens, p = out["tokens"], out["prompt_len"]
    assert out["echoed_tokens"] == tokens and p == len(PROMPT) and len(tokens) > p
    expected = router_top_k(moe_dir, tokens)[:-1]  # one per model-input position
    full, tail = out["matrices"]["full"], out["matrices"]["completion_only"]
    assert [decode(m) for m in full] == expected
    assert tail[: p - 1] == [""] * (p - 1)
    assert [decode(m) for m in tail[p - 1 :]] == expected[p - 1 :]
    sampled = torch.tensor(out["sampling_logprobs"])
    for lp in out["before"]:  # at the sampling weights: replayed or not, the sampler's
        torch.testing.assert_close(torch.tensor(lp[p - 1 :]), sampled, atol=1e-4, rtol=0)

    made = [m for m in live.app.state.tinker.db.select(TinkerModel) if m.id not in before_run]
    assert len(made) == 1
    session = th.engine_session(live, made[0].id)
    w = {n: t.detach().clone().float() for n, t in session.policy.model.state_dict().items()}
    config = session.policy.model.config
    forced = torch.tensor(
        [[list(base64.b64decode(m))[i * 2 : i * 2 + 2] for i in range(2)] for m in full]
    )
    targets = torch.tensor(tokens[1:])
    lp_forced, _ = reference(w, config, tokens[:-1], forced)
    lp_free, own = reference(w, config, tokens[:-1], None)
    replayed, free = torch.tensor(out["after"][0]), torch.tensor(out["after"][2])
    torch.testing.assert_close(
        replayed, lp_forced.gather(-1, targets[:, None])[:, 0], atol=1e-5, rtol=0
    )
    torch.testing.assert_close(free, lp_free.gather(-1, targets[:, None])[:, 0], atol=1e-5, rtol=0)
    if bool((own.sort(-1).values != forced.sort(-1).values).any()):
        assert (replayed - free).abs().max() > 1e-4
    assert "INVALID_INPUT" in out["bad"] and "routing_matrices[2]" in out["bad"], out["bad"]
