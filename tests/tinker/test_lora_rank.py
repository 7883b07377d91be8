"""A model's `max_lora_rank`: 128 by default, so tinker-cookbook's distillation and SDFT recipes
(rank 128) create their sessions on both faces; a rank above the limit is a 400 naming
`lora_config.rank`; and `--model NAME=PATH,max_lora_rank=N`, read by the real `trainer serve`
parser, raises it (docs/semantics.md §9). The adapter a session trains has the rank asked for:
its LoRA factors are checked, not only the reported config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.api.conftest import LiveServer, serve_in_thread
from tests.faults.procs import new_resource, new_session
from tests.tinker import tinker_http as th
from trainer.cli import build_parser, serve_config
from trainer.contract.values import DEFAULT_MAX_LORA_RANK


def _create_model(http: httpx.Client, rank: int) -> httpx.Response:
    body = {
        "session_id": th.new_session(http),
        "model_seq_id": 0,
        "base_model": th.BASE,
        "lora_config": {"rank": rank, "seed": 0},
    }
    return http.post("/create_model", json=body)


def _factor_ranks(session: Any) -> set[int]:
    """The rank of every LoRA factor the session trains (lora_A is [r, in], lora_B [out, r])."""
    ranks = set()
    for name, param in session.policy.trainable.items():
        ranks.add(int(param.shape[0] if ".lora_A." in name else param.shape[1]))
    return ranks


def _rl_session(http: httpx.Client, rank: int) -> httpx.Response:
    rid = new_resource(http, th.BASE)
    body = {"model_resources_id": rid, "lora_config": {"rank": rank, "seed": 0}}
    return http.post("/rl/training-sessions", json=body)


def _tinker_accepts(live: LiveServer, rank: int) -> None:
    with th.client(live) as http:
        response = _create_model(http, rank)
        assert response.status_code == 200, response.text
        model_id = th.wait(http, response.json()["request_id"])["model_id"]
        assert http.post("/get_info", json={"model_id": model_id}).json()["lora_rank"] == rank
        assert _factor_ranks(th.engine_session(live, model_id)) == {rank}


def _tinker_refuses(live: LiveServer, rank: int, limit: int) -> None:
    with th.client(live) as http:
        before = th.records(live)
        refused = _create_model(http, rank)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "lora_config.rank", error
        assert f"{rank} exceeds max_lora_rank {limit}" in error["message"], error
        after = th.records(live)
        assert after["engine sessions"] == before["engine sessions"]


def _rl_accepts(live: LiveServer, rank: int) -> None:
    with live.client() as http:
        rid = new_resource(http, th.BASE)
        sid = new_session(http, rid, lora_config={"rank": rank, "seed": 0})
        assert http.get(f"/rl/training-sessions/{sid}").json()["lora_config"]["rank"] == rank
        assert _factor_ranks(live.worker.sessions[sid].engine) == {rank}


def _rl_refuses(live: LiveServer, rank: int, limit: int) -> None:
    with live.client() as http:
        refused = _rl_session(http, rank)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "lora_config.rank", error
        assert f"{rank} exceeds max_rank {limit}" in error["message"], error


def test_rank_128_is_served_by_default_on_both_faces(tiny_qwen_dir: Path, tmp_path: Path) -> None:
    assert DEFAULT_MAX_LORA_RANK == 128  # the cookbook's distillation / SDFT default
    entry = {"name": th.BASE, "location": str(tiny_qwen_dir)}  # no max_lora_rank: the default
    with serve_in_thread(tmp_path, {}, model=[entry]) as live:
        assert live.worker.config.models[0].max_lora_rank == 128
        _rl_accepts(live, 128)
        _tinker_accepts(live, 128)
        _rl_refuses(live, 129, 128)
        _tinker_refuses(live, 129, 128)
        with live.client() as http:  # the RL face's catalogue reports the limit
            (listed,) = http.get("/rl/supported-models").json()["data"]
        assert listed["compute_configs"][0]["trainer_config"]["lora"]["max_rank"] == 128


def test_the_model_flag_raises_the_limit(tiny_qwen_dir: Path, tmp_path: Path) -> None:
    """`--model NAME=PATH,max_lora_rank=256` through `trainer serve`'s own parser."""
    argv = ["serve", "--storage", str(tmp_path), "--model", f"{th.BASE}={tiny_qwen_dir}"]
    argv[-1] += ",max_lora_rank=256,max_seq_length=128"
    config = serve_config(build_parser().parse_args(argv))
    (entry,) = config.models
    assert (entry.name, entry.location) == (th.BASE, str(tiny_qwen_dir))
    assert (entry.max_lora_rank, entry.max_seq_length) == (256, 128)
    with serve_in_thread(tmp_path, {}, model=[entry.model_dump(exclude_none=True)]) as live:
        _tinker_accepts(live, 256)
        _tinker_refuses(live, 257, 256)
        _rl_refuses(live, 257, 256)


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("m=/x,max_rank=3", "'max_rank' is not a model key"),
        ("m=/x,max_lora_rank=0", "max_lora_rank"),
        ("m=/x,max_lora_rank=many", "max_lora_rank"),
        ("m=/x,max_lora_rank=8,max_lora_rank=9", "given twice"),
        ("m=,max_lora_rank=8", "NAME=PATH_OR_HUB_ID"),
    ],
)
def test_a_bad_model_flag_names_the_key(tmp_path: Path, flag: str, message: str) -> None:
    args = build_parser().parse_args(["serve", "--storage", str(tmp_path), "--model", flag])
    with pytest.raises(ValueError, match=message):
        serve_config(args)


def test_a_comma_in_a_location_stays_in_it(tmp_path: Path) -> None:
    flag = "m=/data/a,b,max_lora_rank=16"
    args = build_parser().parse_args(["serve", "--storage", str(tmp_path), "--model", flag])
    (entry,) = serve_config(args).models
    assert (entry.location, entry.max_lora_rank) == ("/data/a,b", 16)


@pytest.mark.parametrize(
    ("entry_rank", "generator_rank", "replica_rank"),
    [(None, 0, 128), (256, 0, 256), (100, 0, 128), (None, 32, 32), (256, 64, 64)],
)
def test_vllm_replicas_take_the_models_rank(
    tiny_qwen_dir: Path, entry_rank: int | None, generator_rank: int, replica_rank: int
) -> None:
    """The replicas' `max_lora_rank` is `[generator] max_lora_rank`, else (0) the model's limit,
    rounded up to a rank vLLM accepts; the default limit is one of those ranks."""
    import torch

    from trainer.contract.generation import GeneratorOptions
    from trainer.contract.specs import ModelEntry
    from trainer.engine.replica_settings import replica_config

    limits = {} if entry_rank is None else {"max_lora_rank": entry_rank}
    entry = ModelEntry(name=th.BASE, location=str(tiny_qwen_dir), **limits)
    options = GeneratorOptions(backend="vllm", max_lora_rank=generator_rank)
    config = replica_config(entry, options, lora=True, tokenizer=False, device=torch.device("cpu"))
    assert config["max_lora_rank"] == replica_rank


def _unit_columns(session: Any) -> bool:
    """Whether every lora_A (`[rank, in]`) has unit L2 norm over the rank in each column."""
    columns = [
        torch.linalg.vector_norm(p.detach(), dim=0)
        for name, p in session.policy.trainable.items()
        if ".lora_A." in name
    ]
    return bool(columns) and all(torch.allclose(c, torch.ones_like(c)) for c in columns)


def test_nora_init_on_both_faces(tiny_qwen_dir: Path, tmp_path: Path) -> None:
    """`lora_config.init_method` `nora` (the Fireworks SDK's `lora_init_method`) on the Tinker
    face and the RL face; `kaiming`'s columns are not unit; another method is a 400 naming the
    field; the RL face's `lora_config` echo leaves the default out (docs/semantics.md §23)."""
    entry = {"name": th.BASE, "location": str(tiny_qwen_dir)}
    with serve_in_thread(tmp_path, {}, model=[entry]) as live:
        with th.client(live) as http:
            for method, unit in (("nora", True), ("kaiming", False)):
                body = {
                    "session_id": th.new_session(http),
                    "model_seq_id": 0,
                    "base_model": th.BASE,
                    "lora_config": {"rank": 4, "seed": 0, "init_method": method},
                }
                model_id = th.ok(http, "/create_model", body)["model_id"]
                assert _unit_columns(th.engine_session(live, model_id)) is unit, method
            body["lora_config"] = {"rank": 4, "init_method": "pissa"}
            refused = http.post("/create_model", json=body)
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["param"] == "lora_config.init_method"
        with live.client() as http:
            rid = new_resource(http, th.BASE)
            sid = new_session(http, rid, lora_config={"rank": 4, "init_method": "nora"})
            assert _unit_columns(live.worker.sessions[sid].engine)
            echo = http.get(f"/rl/training-sessions/{sid}").json()["lora_config"]
            assert echo["init_method"] == "nora"
            plain = new_session(http, rid, lora_config={"rank": 4})
            assert (
                "init_method"
                not in http.get(f"/rl/training-sessions/{plain}").json()["lora_config"]
            )
