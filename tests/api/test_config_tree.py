"""The config tree: every engine knob is set from the TOML's `[engine]` /
`[distributed]` tables and from `--engine-*` / `--distributed-*` flags, shown in
`configs/serve.example.toml`, validated with errors naming the key, and carried to the live
sessions of a worker, where it changes what the engine does (counted with forward hooks on the
real model: micro-batches, logprob-head chunks, recomputed layers) and not the numbers (checked
against a plain transformers forward).
"""

from __future__ import annotations

import json
import math
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from api_helpers import ce_sample, reference_logprobs
from conftest import LiveServer, serve_in_thread, wait_status

from trainer.cli import build_parser, main, serve_config
from trainer.compute import optim
from trainer.contract.options import ENV_FALLBACKS, SECTIONS, DistributedOptions, EngineOptions
from trainer.serving.config import ServeConfig, load_toml

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "configs" / "serve.example.toml"
CE = {"type": "LOSS_TYPE_CROSS_ENTROPY"}

# (table, key) -> (a value for the TOML, another for the command line); neither is the default
KNOBS: dict[tuple[str, str], tuple[Any, Any]] = {
    ("engine", "row_tokens"): (16, 32),
    ("engine", "token_budget"): (64, 128),
    ("engine", "chunk_tokens"): (8, 4),
    ("engine", "activation_checkpointing"): (True, False),
    ("engine", "master_weights"): (False, True),
    ("engine", "logprob_backend"): ("liger", "ours"),
    ("engine", "merge"): (False, True),
    ("engine", "merge_window_ms"): (5.0, 7.5),
    ("engine", "merge_max_tokens"): (1024, 2048),
    ("engine", "decode_steps_per_turn"): (4, 0),
    ("engine", "batch_samples"): (False, True),
    ("engine", "routes_ttl_s"): (60.0, 30.5),
    ("engine", "routes_max_bytes"): (4096, 8192),
    ("engine", "stability_ttl_s"): (3600.0, 60.0),
    ("engine", "stability_max_bytes"): (1 << 20, 0),
    ("distributed", "cpu_offload"): (True, False),
    ("distributed", "collective_timeout_s"): (8.5, 42.0),
    ("generator", "backend"): ("vllm", "hf"),
    ("generator", "python"): ("/opt/vllm/bin/python", "/usr/bin/python3"),
    ("generator", "dtype"): ("bfloat16", "float32"),
    ("generator", "max_model_len"): (1024, 2048),
    ("generator", "gpu_memory_utilization"): (0.5, 0.6),
    ("generator", "kv_cache_gib"): (2, 3),
    ("generator", "max_loras"): (4, 16),
    ("generator", "max_lora_rank"): (32, 128),
    ("generator", "enforce_eager"): (False, True),
    ("generator", "threads"): (2, 4),
    ("generator", "start_timeout_s"): (30.0, 60.5),
    ("generator", "extra_engine_args"): ({"block_size": 16}, {"seed": 3}),
    ("generator", "env"): ({"OMP_WAIT_POLICY": "PASSIVE"}, {"KMP_BLOCKTIME": "0"}),
}


def _toml_value(value: Any) -> str:
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, bool):
        return "true" if value else "false"
    return f'"{value}"' if isinstance(value, str) else str(value)


def _flag_args(section: str, key: str, value: Any) -> list[str]:
    flag = f"--{section}-{key.replace('_', '-')}"
    if isinstance(value, bool):
        return [flag if value else f"--no-{flag[2:]}"]
    return [flag, json.dumps(value) if isinstance(value, dict) else str(value)]


def _config(tmp_path: Path, toml: str, *flags: str) -> ServeConfig:
    path = tmp_path / f"{uuid.uuid4().hex}.toml"
    path.write_text(f'storage = "{tmp_path}"\n{toml}')
    config: ServeConfig = serve_config(
        build_parser().parse_args(["serve", "--config", str(path), *flags])
    )
    return config


def test_every_knob_is_covered_here_and_in_the_example() -> None:
    """The example lists each key of each options table, with its default, and nothing else."""
    fields = {(s, k) for s, model in SECTIONS.items() for k in model.model_fields}
    assert set(KNOBS) == fields  # a new knob must be tested here
    example = load_toml(EXAMPLE)
    for section, model in SECTIONS.items():
        assert set(example[section]) == set(model.model_fields), section
        assert model.model_validate(example[section]) == model(), section
    config = ServeConfig.model_validate(example)
    assert config.engine == EngineOptions() and config.distributed == DistributedOptions()


@pytest.mark.parametrize(("section", "key"), list(KNOBS))
def test_each_knob_from_toml_and_from_the_command_line(
    tmp_path: Path, section: str, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ENV_FALLBACKS.values():
        monkeypatch.delenv(name, raising=False)
    in_toml, on_cli = KNOBS[(section, key)]
    default = getattr(SECTIONS[section](), key)
    assert in_toml != default and on_cli != in_toml
    table = f"[{section}]\n{key} = {_toml_value(in_toml)}\n"
    assert getattr(getattr(_config(tmp_path, ""), section), key) == default
    assert getattr(getattr(_config(tmp_path, table), section), key) == in_toml
    flags = _flag_args(section, key, on_cli)
    assert getattr(getattr(_config(tmp_path, table, *flags), section), key) == on_cli
    alone = _flag_args(section, key, in_toml)  # no TOML table at all
    assert getattr(getattr(_config(tmp_path, "", *alone), section), key) == in_toml
    # the rest of the table keeps its defaults
    others = SECTIONS[section]().model_dump(exclude={key})
    assert getattr(_config(tmp_path, table), section).model_dump(exclude={key}) == others


# top-level keys of the audit trail and the metrics port: (TOML value, flag or None if none)
TOP_LEVEL: dict[str, tuple[Any, list[str] | None]] = {
    "audit_max_bytes": (1 << 20, None),
    "audit_keep": (9, None),
    "metrics_port": (9100, ["--metrics-port", "9200"]),
    "metrics_host": ("::1", ["--metrics-host", "0.0.0.0"]),
}


@pytest.mark.parametrize("key", list(TOP_LEVEL))
def test_audit_and_metrics_keys(tmp_path: Path, key: str) -> None:
    in_toml, flags = TOP_LEVEL[key]
    default = ServeConfig.model_fields[key].default
    assert in_toml != default
    assert getattr(_config(tmp_path, ""), key) == default
    assert getattr(_config(tmp_path, f"{key} = {_toml_value(in_toml)}\n"), key) == in_toml
    if flags is not None:
        on_cli = type(in_toml)(flags[1])
        got = _config(tmp_path, f"{key} = {_toml_value(in_toml)}\n", *flags)
        assert getattr(got, key) == on_cli != in_toml
    example = load_toml(EXAMPLE)
    assert key in example or f"# {key} =" in EXAMPLE.read_text()


@pytest.mark.parametrize(
    "toml", ["audit_max_bytes = 10\n", "audit_keep = 0\n", "metrics_port = 70000\n"]
)
def test_bad_audit_and_metrics_keys_name_the_key(tmp_path: Path, toml: str) -> None:
    with pytest.raises(ValueError, match=toml.split(" ")[0]):
        _config(tmp_path, toml)


def test_legacy_environment_variables_fill_unset_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRAINER_DIST_TIMEOUT_S", "8")
    monkeypatch.setenv("TRAINER_LOGPROBS_BACKEND", "liger")
    config = _config(tmp_path, "")
    assert config.distributed.collective_timeout_s == 8.0
    assert config.engine.logprob_backend == "liger"
    config = _config(
        tmp_path,
        "[distributed]\ncollective_timeout_s = 9\n",
        "--engine-logprob-backend",
        "ours",
    )
    assert config.distributed.collective_timeout_s == 9.0
    assert config.engine.logprob_backend == "ours"
    monkeypatch.setenv("TRAINER_DIST_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match=r"distributed\.collective_timeout_s"):
        _config(tmp_path, "")


@pytest.mark.parametrize(
    ("toml", "flags", "named"),
    [
        ("[engine]\nrow_tokenz = 16\n", [], "engine.row_tokenz: Extra inputs are not permitted"),
        ("[distributed]\noffload = true\n", [], "distributed.offload: Extra inputs"),
        ("[engine]\nrow_tokens = 0\n", [], "engine.row_tokens: Input should be greater than"),
        ("[engine]\nlogprob_backend = 'fast'\n", [], "engine.logprob_backend: Input should be"),
        ("engine = 3\n", [], "engine: Input should be"),
        ("[engine]\nactivation_checkpointing = 'maybe'\n", [], "engine.activation_checkpointing"),
        ("", ["--engine-token-budget", "0"], "engine.token_budget: Input should be greater"),
        ("", ["--distributed-collective-timeout-s", "0"], "distributed.collective_timeout_s"),
    ],
)
def test_bad_settings_name_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], toml: str, flags: list[str], named: str
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(f'storage = "{tmp_path}"\n{toml}')
    argv = ["serve", "--config", str(path), "--model", "m=/nowhere", *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "invalid settings" in err and named in err, err


def test_bad_flag_values_are_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    for flags, named in [
        (["--engine-row-tokens", "many"], "--engine-row-tokens: invalid int value"),
        (["--engine-logprob-backend", "fast"], "--engine-logprob-backend: invalid choice"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            build_parser().parse_args(["serve", *flags])
        assert exit_info.value.code == 2
        assert named in capsys.readouterr().err


# -- the knobs reach the engine ------------------------------------------------------------------


class Counter:
    """Forward hooks on the real model of a live resource: calls per module."""

    def __init__(self, modules: dict[str, torch.nn.Module]) -> None:
        self.calls = dict.fromkeys(modules, 0)
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in modules.items()]

    def _hook(self, name: str) -> Any:
        def hook(*_: Any) -> None:
            self.calls[name] += 1

        return hook

    def take(self) -> dict[str, int]:
        calls, self.calls = self.calls, dict.fromkeys(self.calls, 0)
        return calls

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def _op(http: httpx.Client, sid: str, body: dict[str, Any]) -> dict[str, Any]:
    url = f"/rl/training-sessions/{sid}/operations/forward-backward"
    response = http.post(url, json=body, headers={"Idempotency-Key": uuid.uuid4().hex})
    assert response.status_code == 200, response.text
    op: dict[str, Any] = response.json()
    while not op["status"].endswith(("COMPLETED", "FAILED")):
        op = http.get(f"{url}/{op['id']}").json()
    assert op["status"].endswith("COMPLETED"), op
    return op["output"]


def _session(live: LiveServer, http: httpx.Client) -> tuple[str, Any]:
    response = http.post("/rl/model-resources", json={"base_model": "tiny-qwen"})
    assert response.status_code == 200, response.text
    rid = response.json()["id"]
    wait_status(http, f"/rl/model-resources/{rid}", "MODEL_RESOURCES_STATUS_READY")
    body = {"model_resources_id": rid, "lora_config": {"rank": 4, "seed": 0}}
    response = http.post("/rl/training-sessions", json=body)
    assert response.status_code == 200, response.text
    sid = response.json()["id"]
    return sid, live.worker.resources.get_live(rid).engine  # type: ignore[union-attr]


SEQUENCES = [[3 + i, 17, 42 + i, 9, 88, 5, 61 + i, 20, 11, 30 + i] for i in range(4)]  # 9 tokens


SMALL = [
    *("--engine-row-tokens", "9", "--engine-token-budget", "9", "--engine-chunk-tokens", "4"),
    "--engine-activation-checkpointing",
    "--no-engine-master-weights",
]


@pytest.mark.parametrize("flags", [[], SMALL], ids=["defaults", "small"])
def test_the_knobs_reach_every_live_session(
    tiny_qwen_dir: Path, tmp_path: Path, flags: list[str]
) -> None:
    """From the command line to the worker's sessions: row tokens and the token budget set the
    number of micro-batches (decoder calls), chunk tokens the head calls per micro-batch,
    activation checkpointing a second forward of each layer in the backward; the logprobs stay
    those of a plain transformers forward."""
    config = _config(tmp_path, "[engine]\nlogprob_backend = 'ours'\n", *flags)
    engine = config.engine
    models = {"tiny-qwen": tiny_qwen_dir}
    with (
        serve_in_thread(tmp_path / "s", models, engine=engine.model_dump()) as live,
        live.client() as http,
    ):
        sid, resource = _session(live, http)
        assert live.worker.sessions[sid].engine.options == engine
        optimizer = live.worker.sessions[sid].engine.optimizer
        assert isinstance(optimizer, optim.MasterAdamW) is engine.master_weights
        model = resource.model
        counter = Counter(
            # a layer's attention: its output is saved for the MLP, so a recompute runs it
            # whole (the layer itself is called once either way: its `forward` is checkpointed)
            {
                "layer": model.get_decoder().layers[0].self_attn,
                "head": model.get_output_embeddings(),
            }
        )
        try:
            samples = [ce_sample(s) for s in SEQUENCES]
            body = {"loss": CE, "samples": samples, "forward_only": True}
            out = _op(http, sid, {**body, "return_loss_fn_outputs": True})
            forward = counter.take()
            _op(http, sid, {**body, "forward_only": False})
            backward = counter.take()
        finally:
            counter.close()
    # tokens per micro-batch: each 9-token sample fills a row of 9 and a budget of 9, else
    # all of them fit in one row
    tokens = [len(s) - 1 for s in SEQUENCES]
    batches = tokens if engine.token_budget < 2 * tokens[0] else [sum(tokens)]
    assert forward["layer"] == len(batches)
    assert forward["head"] == sum(math.ceil(n / engine.chunk_tokens) for n in batches)
    assert backward["layer"] == len(batches) * (2 if engine.activation_checkpointing else 1)
    assert model.is_gradient_checkpointing is engine.activation_checkpointing

    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tiny_qwen_dir, torch_dtype=torch.float32)
    for result, sequence in zip(out["loss_fn_outputs"], SEQUENCES):
        got = torch.tensor(result["tensors"]["logprobs"]["data"])
        want = torch.tensor(reference_logprobs(plain, sequence))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_trainer_serve_help_lists_every_flag() -> None:
    import subprocess

    done = subprocess.run(
        [sys.executable, "-m", "trainer", "serve", "--help"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    for section, key in KNOBS:
        assert f"--{section}-{key.replace('_', '-')}" in done.stdout
