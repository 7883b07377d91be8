"""`GET /metrics` on a worker with two users and an admin: parsed by prometheus_client's own
parser, counters that grow by exactly what was sent and sampled, admin-only on the main port,
open on the separate loopback metrics port."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from api_helpers import ce_sample, model_input
from conftest import LiveServer, serve_in_thread, wait_status
from prometheus_client.parser import text_string_to_metric_families
from team_helpers import team

from trainer.api.metrics import METRICS
from trainer.spawn import free_port

CE = {"type": "LOSS_TYPE_CROSS_ENTROPY"}
SEQUENCES = [[3, 17, 42, 9, 88, 5, 61, 20], [7, 7, 100, 2, 45, 12]]


@pytest.fixture(scope="module")
def live(
    tiny_qwen_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LiveServer, dict[str, str], int]]:
    tmp = tmp_path_factory.mktemp("metrics")
    ring, keys = team(tmp)
    port = free_port()
    models = {"tiny-qwen": tiny_qwen_dir}
    with serve_in_thread(tmp / "storage", models, None, ring, metrics_port=port) as server:
        yield server, keys, port


def client(server: LiveServer, key: str | None) -> httpx.Client:
    return server.client(key)


def scrape(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value, through prometheus_client's parser."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def metric(values: dict[Any, float], name: str, **labels: str) -> float:
    return values.get((name, tuple(sorted(labels.items()))), 0.0)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def admin_scrape(server: LiveServer, keys: dict[str, str]) -> dict[Any, float]:
    response = httpx.get(
        f"{server.url}/metrics", headers={"Authorization": f"Bearer {keys['root']}"}
    )
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return scrape(response.text)


def op(http: httpx.Client, sid: str, kind: str, body: dict[str, Any]) -> dict[str, Any]:
    url = f"/rl/training-sessions/{sid}/operations/{kind}"
    response = http.post(url, json=body, headers={"Idempotency-Key": uuid.uuid4().hex})
    assert response.status_code == 200, response.text
    row: dict[str, Any] = response.json()
    while not row["status"].endswith(("COMPLETED", "FAILED")):
        row = http.get(f"{url}/{row['id']}").json()
    assert row["status"].endswith("COMPLETED"), row
    return row


def test_counters_grow_by_what_was_sent_and_sampled(
    live: tuple[LiveServer, dict[str, str], int],
) -> None:
    server, keys, _ = live
    before = admin_scrape(server, keys)
    with client(server, keys["alice"]) as http:
        rid = http.post("/rl/model-resources", json={"base_model": "tiny-qwen"}).json()["id"]
        wait_status(http, f"/rl/model-resources/{rid}", "MODEL_RESOURCES_STATUS_READY")
        body = {"model_resources_id": rid, "lora_config": {"rank": 2, "seed": 0}}
        sid = http.post("/rl/training-sessions", json=body).json()["id"]
        wait_status(http, f"/rl/training-sessions/{sid}", "TRAINING_SESSION_STATUS_RUNNING")
        samples = [ce_sample(s) for s in SEQUENCES]
        op(http, sid, "forward-backward", {"loss": CE, "samples": samples})
        op(http, sid, "forward-backward", {"loss": CE, "samples": samples, "forward_only": True})
        sample_body = {
            "model_inputs": [model_input([1, 2, 3]), model_input([4, 5])],
            "num_samples": 2,
            "sampling_params": {"max_tokens": 3, "temperature": 1.0},
        }
        out = op(http, sid, "sample", sample_body)["output"]
    sampled = sum(len(s["tokens"]) for r in out["results"] for s in r["sequences"])
    assert sampled > 0
    after = admin_scrape(server, keys)

    def grew(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    trained = sum(len(s) - 1 for s in SEQUENCES)  # each sample's input tokens
    assert grew("trainer_tokens_trained_total", user="alice") == trained
    assert grew("trainer_tokens_sampled_total", user="alice") == sampled
    fb = {"kind": "forward-backward", "user": "alice"}
    assert grew("trainer_operations_total", outcome="completed", **fb) == 2
    assert grew("trainer_operations_total", kind="sample", outcome="completed", user="alice") == 1
    assert grew("trainer_operation_seconds_count", **fb) == 2
    assert grew("trainer_operation_seconds_sum", **fb) > 0
    assert grew("trainer_operation_seconds_bucket", le="+Inf", **fb) == 2
    assert metric(after, "trainer_queue_depth", session=sid) == 0
    # a resource and a session of their owner
    assert metric(after, "trainer_resources", user="alice") == 1
    assert metric(after, "trainer_sessions", user="alice") == 1
    engine = server.worker.resources.get_live(rid).engine  # type: ignore[union-attr]
    counters = engine.counters()  # the schedulers' own counts, as /v1/rl/worker-metrics shows
    for name, key in (
        ("trainer_passes_total", "passes"),
        ("trainer_merged_passes_total", "merged_passes"),
        ("trainer_merged_calls_total", "merged_items"),
        ("trainer_sample_batches_total", "sample_batches"),
        ("trainer_batched_samples_total", "batched_samples"),
    ):
        assert (name, (("resource", rid),)) in after, name
        assert metric(after, name, resource=rid) == counters[key], name
    assert metric(after, "trainer_process_resident_memory_bytes") > 10 << 20
    assert metric(after, "trainer_process_threads") >= 2
    # a checkpoint's bytes: those its manifest lists
    with client(server, keys["alice"]) as http:
        saved = op(http, sid, "inference-checkpoint", {})["output"]["checkpoint"]["id"]
        http.post(f"/rl/training-sessions/{sid}/stop")
    size = sum(f.size for f in server.worker.checkpoints.manifest_files(saved))
    assert metric(admin_scrape(server, keys), "trainer_checkpoint_bytes", user="alice") == size


def test_every_metric_is_documented_and_named_trainer(
    live: tuple[LiveServer, dict[str, str], int],
) -> None:
    server, keys, _ = live
    response = httpx.get(
        f"{server.url}/metrics", headers={"Authorization": f"Bearer {keys['root']}"}
    )
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    # the parser names a counter without its _total suffix
    documented = {name.removesuffix("_total"): spec for name, spec in METRICS.items()}
    assert set(families) == set(documented)
    for name, family in families.items():
        kind, _, help_text = documented[name]
        assert name.startswith("trainer_") and family.type == kind
        assert family.documentation == help_text
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    for name in METRICS:
        assert f"`{name}`" in readme, name


def test_only_an_admin_reads_metrics_on_the_main_port(
    live: tuple[LiveServer, dict[str, str], int],
) -> None:
    server, keys, _ = live
    missing = httpx.get(f"{server.url}/no-such-route")
    for headers in ({}, bearer(keys["alice"]), {"Authorization": "x"}):
        response = httpx.get(f"{server.url}/metrics", headers=headers)
        assert response.status_code == 404, headers
        assert response.json() == missing.json()  # as if the route did not exist


def test_the_metrics_port_serves_without_a_key_on_loopback(
    live: tuple[LiveServer, dict[str, str], int],
) -> None:
    server, keys, port = live
    response = httpx.get(f"http://127.0.0.1:{port}/metrics")
    assert response.status_code == 200
    values = scrape(response.text)
    assert metric(values, "trainer_process_threads") >= 2
    # the same registry as the main port's
    assert {k[0] for k in values} == {k[0] for k in admin_scrape(server, keys)}


def test_metrics_port_settings() -> None:
    from trainer.cli import build_parser, serve_config

    args = ["serve", "--storage", "/tmp/x", "--metrics-port", "9100"]
    config = serve_config(build_parser().parse_args(args))
    assert (config.metrics_port, config.metrics_host) == (9100, "127.0.0.1")
    args += ["--metrics-host", "0.0.0.0"]
    assert serve_config(build_parser().parse_args(args)).metrics_host == "0.0.0.0"
    assert (
        serve_config(build_parser().parse_args(["serve", "--storage", "/x"])).metrics_port is None
    )
