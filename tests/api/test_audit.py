"""The audit trail: a line per mutating call of both faces (route template, user, status), no
body content and no key in it, rotation by size, a restart that continues it, and the admin's
paginated `GET /v1/rl/audit`."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from api_helpers import ce_sample
from conftest import LiveServer, serve_in_thread, wait_status
from team_helpers import team

from tests.tinker import tinker_http as th
from trainer.api.audit import audited, mounted_routes
from trainer.serving import audit_log
from trainer.serving.audit_log import AuditLog

CE = {"type": "LOSS_TYPE_CROSS_ENTROPY"}
MARKER = f"marker-{uuid.uuid4().hex}"  # sent in bodies; must never reach the audit file

# Every audited (method, route) of the app: a route added later must be classified here.
AUDITED = {
    ("POST", "/v1/rl/model-resources"),
    ("POST", "/v1/rl/model-resources/{model_resources_id}/extend-expiry"),
    ("POST", "/v1/rl/model-resources/{model_resources_id}/stop"),
    ("GET", "/v1/rl/checkpoints/{checkpoint_id}/download"),
    ("POST", "/v1/rl/training-sessions"),
    ("PATCH", "/v1/rl/training-sessions/{session_id}"),
    ("POST", "/v1/rl/training-sessions/{session_id}/stop"),
    ("POST", "/v1/rl/training-sessions/{session_id}/payloads/upload-url"),
    ("POST", "/v1/rl/training-sessions/{session_id}/payloads/{payload_id}/download-url"),
    *(
        ("POST", f"/v1/rl/training-sessions/{{session_id}}/operations/{kind}")
        for kind in (
            "forward-backward",
            "custom-forward-backward",
            "optim-step",
            "weights-sync",
            "sample",
            "training-checkpoint",
            "inference-checkpoint",
        )
    ),
    ("GET", "/v1/rl/files/checkpoints/{checkpoint_id}/{variant}/{filename}"),
    ("PUT", "/v1/rl/payloads/{session_id}/{payload_id}"),
    ("GET", "/v1/rl/payloads/{session_id}/{payload_id}"),
    *(
        ("POST", f"/api/v1/{name}")
        for name in (
            "create_session",
            "sessions/{session_id}/finish",
            "create_model",
            "forward",
            "forward_backward",
            "optim_step",
            "save_weights",
            "save_weights_for_sampler",
            "save_weights_external",
            "load_weights",
            "load_adapter",
            "unload_model",
            "create_sampling_session",
            "asample",
        )
    ),
    (
        "GET",
        "/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/external_weights_urls",
    ),
    ("PUT", "/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/ttl"),
    ("DELETE", "/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id:path}"),
    ("POST", "/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish"),
    ("DELETE", "/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish"),
    ("POST", "/api/v1/copy_weights"),
    # the Fireworks control plane (a job's own Tinker routes are audited as /api/v1/...)
    ("POST", "/v1/accounts/{account}/rlorTrainerJobs"),
    ("DELETE", "/v1/accounts/{account}/rlorTrainerJobs/{job_id}"),
    ("POST", "/v1/accounts/{account}/rlorTrainerJobs/{job_id}:resume"),
    ("POST", "/v1/accounts/{account}/checkpoints/{checkpoint}:promote"),
    ("POST", "/v1/accounts/{account}/deployments"),
    ("PATCH", "/v1/accounts/{account}/deployments/{deployment_id}"),
    ("DELETE", "/v1/accounts/{account}/deployments/{deployment_id}"),
    (
        "POST",
        "/v1/accounts/{account}/trainingSessions/{session_id}/checkpoints/{checkpoint}:promote",
    ),
    ("DELETE", "/v1/accounts/{account}/trainingSessions/{session_id}"),
    # the serverless surface's own routes (its other Tinker routes are audited as /api/v1/...)
    *(
        ("POST", f"/training/v1/serverless/api/v1/{name}")
        for name in ("create_session", "create_model", "create_sampling_route")
    ),
    ("POST", "/hot_load/v1/models/hot_load"),
    ("POST", "/inference/v1/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/inference/v1/chat/completions"),
    ("POST", "/v1/chat/completions"),
}


@pytest.fixture(scope="module")
def live(
    tiny_qwen_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LiveServer, dict[str, str]]]:
    tmp = tmp_path_factory.mktemp("audit")
    ring, keys = team(tmp)
    with serve_in_thread(tmp / "storage", {"tiny-qwen": tiny_qwen_dir}, None, ring) as server:
        yield server, keys


def lines(storage: Path) -> list[dict[str, Any]]:
    path = storage / "audit.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def routes_of(app: Any) -> set[tuple[str, str]]:
    return {
        (method, path)
        for route, path in mounted_routes(app.router.routes)
        for method in getattr(route, "methods", None) or ()
    }


def test_every_route_is_classified(live: tuple[LiveServer, dict[str, str]]) -> None:
    server, _ = live
    assert {(m, p) for m, p in routes_of(server.app) if audited(m, p)} == AUDITED


def op(http: httpx.Client, sid: str, kind: str, body: dict[str, Any]) -> dict[str, Any]:
    url = f"/rl/training-sessions/{sid}/operations/{kind}"
    response = http.post(url, json=body, headers={"Idempotency-Key": uuid.uuid4().hex})
    assert response.status_code == 200, response.text
    row: dict[str, Any] = response.json()
    while not row["status"].endswith(("COMPLETED", "FAILED")):
        row = http.get(f"{url}/{row['id']}").json()
    return row


def test_each_mutating_route_of_both_faces_writes_one_line(
    live: tuple[LiveServer, dict[str, str]],
) -> None:
    """Drive the routes of `AUDITED`; each call is one line naming its route template, user,
    status and path ids, and the bodies' marker and every key stay out of the file."""
    server, keys = live
    start = len(lines(server.storage))
    sent: list[tuple[str, str, int, str | None]] = []  # method, template, status, user

    def note(response: httpx.Response, template: str, user: str | None) -> httpx.Response:
        sent.append((response.request.method, template, response.status_code, user))
        return response

    rl = "/v1/rl"
    with server.client(keys["alice"]) as http:
        made = http.post("/rl/model-resources", json={"base_model": "tiny-qwen"})
        rid = note(made, f"{rl}/model-resources", "alice").json()["id"]
        wait_status(http, f"/rl/model-resources/{rid}", "MODEL_RESOURCES_STATUS_READY")
        extend = http.post(f"/rl/model-resources/{rid}/extend-expiry", json={"seconds": 600})
        note(extend, f"{rl}/model-resources/{{model_resources_id}}/extend-expiry", "alice")
        body = {"model_resources_id": rid, "display_name": MARKER, "lora_config": {"rank": 2}}
        sid = note(
            http.post("/rl/training-sessions", json=body), f"{rl}/training-sessions", "alice"
        )
        sid = sid.json()["id"]
        wait_status(http, f"/rl/training-sessions/{sid}", "TRAINING_SESSION_STATUS_RUNNING")
        patched = http.patch(f"/rl/training-sessions/{sid}", json={"display_name": MARKER + "2"})
        note(patched, f"{rl}/training-sessions/{{session_id}}", "alice")
        ops = f"{rl}/training-sessions/{{session_id}}/operations"
        fb = {"loss": CE, "samples": [ce_sample([3, 17, 42, 9])]}
        for kind, op_body in (
            ("forward-backward", fb),
            ("optim-step", {}),
            ("weights-sync", {}),
            ("inference-checkpoint", {}),
        ):
            url = f"/rl/training-sessions/{sid}/operations/{kind}"
            key = {"Idempotency-Key": uuid.uuid4().hex}
            note(http.post(url, json=op_body, headers=key), f"{ops}/{kind}", "alice")
        bad = http.post(  # a refused operation is a line too, with its status
            f"/rl/training-sessions/{sid}/operations/sample",
            json={"model_inputs": MARKER},
            headers={"Idempotency-Key": uuid.uuid4().hex},
        )
        assert bad.status_code == 400
        note(bad, f"{ops}/sample", "alice")
        checkpoint = op(http, sid, "training-checkpoint", {})
        sent.append(("POST", f"{ops}/training-checkpoint", 200, "alice"))
        saved = op(http, sid, "inference-checkpoint", {})["output"]["checkpoint"]["id"]
        sent.append(("POST", f"{ops}/inference-checkpoint", 200, "alice"))
        assert checkpoint["status"].endswith("COMPLETED")
        files = http.get(
            f"/rl/checkpoints/{saved}/download", params={"variant": "CHECKPOINT_VARIANT_ADAPTER"}
        )
        note(files, f"{rl}/checkpoints/{{checkpoint_id}}/download", "alice")
        signed = files.json()["data"][0]["url"]
        file_route = f"{rl}/files/checkpoints/{{checkpoint_id}}/{{variant}}/{{filename}}"
        note(httpx.get(signed), file_route, "alice")  # no key: the user the URL was issued to
        upload = http.post(f"/rl/training-sessions/{sid}/payloads/upload-url")
        note(upload, f"{rl}/training-sessions/{{session_id}}/payloads/upload-url", "alice")
        put_url, pid = upload.json()["upload_url"], upload.json()["payload_id"]
        payload = json.dumps({"marker": MARKER}).encode()
        note(
            httpx.put(put_url, content=payload),
            f"{rl}/payloads/{{session_id}}/{{payload_id}}",
            "alice",
        )
        down = http.post(f"/rl/training-sessions/{sid}/payloads/{pid}/download-url")
        template = f"{rl}/training-sessions/{{session_id}}/payloads/{{payload_id}}/download-url"
        note(down, template, "alice")
        note(
            httpx.get(down.json()["download_url"]),
            f"{rl}/payloads/{{session_id}}/{{payload_id}}",
            "alice",
        )
        note(http.post(f"/rl/training-sessions/{sid}/stop"), f"{ops[:-11]}/stop", "alice")
    with server.client(keys["bob"]) as http:
        stop = http.post(f"/rl/model-resources/{rid}/stop", json={"force": True})
        note(stop, f"{rl}/model-resources/{{model_resources_id}}/stop", "bob")
    with server.client("not-a-key") as http:  # refused before a user is known
        note(
            http.post("/rl/model-resources", json={"base_model": MARKER}),
            f"{rl}/model-resources",
            None,
        )
    # the Tinker face, as bob: the SDK's key spelling
    with th.client(server, **{"X-API-Key": f"tml-{keys['bob']}"}) as tk:
        tinker = "/api/v1"
        created = tk.post("/create_session", json={"tags": [MARKER], "sdk_version": "0.38.0"})
        note(created, f"{tinker}/create_session", "bob")
        session = created.json()["session_id"]
        body = {"session_id": session, "model_seq_id": 0, "base_model": th.BASE}
        body["lora_config"] = {"rank": 2, "seed": 0}
        response = tk.post("/create_model", json=body)
        note(response, f"{tinker}/create_model", "bob")
        model = th.wait(tk, response.json()["request_id"])["model_id"]
        reads = len(sent)
        tk.post("/session_heartbeat", json={"session_id": session})  # reads: not audited
        th.wait(tk, tk.post("/forward_backward", json=th.fb_body(model)).json()["request_id"])
        sent.append(("POST", f"{tinker}/forward_backward", 200, "bob"))
        assert len(sent) == reads + 1
        saved_path = th.ok(tk, "/save_weights", {"model_id": model, "path": "mine"})["path"]
        sent.append(("POST", f"{tinker}/save_weights", 200, "bob"))
        asked = {
            "base_model": th.BASE,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
            "num_samples": 1,
            "sampling_params": {"max_tokens": 2, "seed": 0},
        }
        note(tk.post("/asample", json=asked), f"{tinker}/asample", "bob")
        checkpoint_id = saved_path.split(f"{model}/", 1)[1]
        deleted = tk.delete(f"/training_runs/{model}/checkpoints/{checkpoint_id}")
        note(
            deleted, f"{tinker}/training_runs/{{run_id}}/checkpoints/{{checkpoint_id:path}}", "bob"
        )
        note(
            tk.post(f"/sessions/{session}/finish"),
            f"{tinker}/sessions/{{session_id}}/finish",
            "bob",
        )

    deadline = time.monotonic() + 10  # a line is written once its response has been sent
    while len(written := lines(server.storage)[start:]) < len(sent) and time.monotonic() < deadline:
        time.sleep(0.05)
    got = [(e["method"], e["route"], e["status"], e["user"]) for e in written]
    assert sorted(got, key=str) == sorted(sent, key=str)
    text = (server.storage / "audit.jsonl").read_text()
    assert MARKER not in text
    for key in keys.values():
        assert key not in text
    assert "sig=" not in text and "expires=" not in text  # no signed-URL query string
    by_route = {(e["method"], e["route"]): e for e in written}
    stop_line = by_route[("POST", f"{rl}/training-sessions/{{session_id}}/stop")]
    assert stop_line["ids"] == {"session_id": sid}
    create_line = by_route[("POST", f"{rl}/training-sessions")]
    assert create_line["ids"] == {} and create_line["created"] == sid
    for entry in written:
        assert set(entry) == {
            "seq",
            "time",
            "user",
            "method",
            "route",
            "ids",
            "created",
            "status",
            "request_id",
        }
    assert [e["seq"] for e in written] == sorted(e["seq"] for e in written)


def test_reading_is_for_admins_and_paginates(live: tuple[LiveServer, dict[str, str]]) -> None:
    server, keys = live
    with server.client(keys["alice"]) as http:
        for _ in range(5):  # refused creates: five more lines of alice's
            http.post("/rl/model-resources", json={"base_model": "no-such-model"})
    missing = httpx.get(f"{server.url}/v1/rl/no-such-route")
    for key in (None, keys["alice"], "not-a-key"):
        with server.client(key) as http:
            for response in (
                http.get("/rl/audit"),
                http.get("/rl/audit", params={"limit": "0"}),
                http.post("/rl/audit", json={}),
            ):
                assert response.status_code == 404 and response.json() == missing.json()
    total = len(lines(server.storage))
    with server.client(keys["root"]) as http:
        seen: list[int] = []
        before = None
        while True:
            params = {"limit": 3, **({"before": before} if before else {})}
            page = http.get("/rl/audit", params=params).json()
            seen.extend(e["seq"] for e in page["data"])
            assert len(page["data"]) <= 3
            if not page["has_more"]:
                assert page["next_before"] is None
                break
            before = page["next_before"]
        assert seen == sorted(seen, reverse=True) and len(seen) == total  # newest first
        alice = http.get("/rl/audit", params={"user": "alice", "limit": 1000}).json()["data"]
        assert alice and all(e["user"] == "alice" for e in alice)
        assert len(alice) == sum(e["user"] == "alice" for e in lines(server.storage))
        assert http.get("/rl/audit", params={"limit": "x"}).status_code == 400
        assert http.get("/rl/audit", params={"user": "a b"}).status_code == 400


def test_rotation_by_size_and_restart(tmp_path: Path) -> None:
    log = AuditLog(tmp_path, max_bytes=1024, keep=2)
    entry = {"user": "alice", "method": "POST", "route": "/r", "ids": {}, "status": 200}
    threads = [
        threading.Thread(target=lambda: [log.append(entry) for _ in range(25)]) for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["audit.jsonl", "audit.jsonl.1", "audit.jsonl.2"]
    for path in tmp_path.iterdir():
        assert path.stat().st_size <= 1024
        for line in path.read_text().splitlines():
            json.loads(line)  # whole lines: concurrent appends never interleave
    kept = [e["seq"] for e in log.page(1000)[0]]
    assert kept == list(range(100, 100 - len(kept), -1)) and 10 < len(kept) < 100
    # a restart continues the numbering, appending
    again = AuditLog(tmp_path, max_bytes=1024, keep=2)
    again.append(entry)
    assert again.page(1)[0][0]["seq"] == 101
    # a line cut short by a crash is skipped
    with (tmp_path / "audit.jsonl").open("a") as handle:
        handle.write('{"seq": 102, "us')
    assert AuditLog(tmp_path, 1024, 2).page(1)[0][0]["seq"] == 101


def test_a_failing_write_is_dropped_not_raised(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "gone", max_bytes=1024, keep=2)  # its directory does not exist
    log.append({"user": "alice"})
    assert log.dropped == 1 and log.page(10) == ([], False)


def test_the_trail_survives_a_restart(tiny_qwen_dir: Path, tmp_path: Path) -> None:
    ring, keys = team(tmp_path)
    storage = tmp_path / "storage"
    models = {"tiny-qwen": tiny_qwen_dir}
    for _ in range(2):
        with (
            serve_in_thread(storage, models, None, ring) as server,
            server.client(keys["bob"]) as http,
        ):
            http.post("/rl/model-resources", json={"base_model": "no-such-model"})
    written = lines(storage)
    assert [e["seq"] for e in written] == [1, 2] and {e["user"] for e in written} == {"bob"}


def test_a_short_write_is_truncated_back_and_loses_no_later_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk that takes half a line: the half is cut back off, so the next line (once
    there is space) is whole and read; before, it was glued onto the fragment and lost."""
    log = AuditLog(tmp_path, max_bytes=1 << 20, keep=2)
    entry = {"user": "alice", "method": "POST", "route": "/r", "ids": {}, "status": 200}
    log.append(entry)
    real_write = audit_log.os.write
    monkeypatch.setattr(audit_log.os, "write", lambda fd, data: real_write(fd, data[:20]))
    log.append({**entry, "user": "mallory"})  # the disk fills mid-line
    monkeypatch.setattr(audit_log.os, "write", real_write)
    log.append({**entry, "user": "bob"})  # space again
    text = (tmp_path / "audit.jsonl").read_text()
    assert [json.loads(line)["user"] for line in text.splitlines()] == ["alice", "bob"]
    assert [e["user"] for e in log.page(10)[0]] == ["bob", "alice"] and log.dropped == 1


def test_a_damaged_line_is_skipped_and_reported_not_the_next(tmp_path: Path) -> None:
    """A fragment a crash left (no final newline): a line appended after it starts on its
    own; a line glued onto one (a file written before) is still read; both are counted."""
    path = tmp_path / "audit.jsonl"
    line = {"user": "alice", "method": "POST", "route": "/r", "ids": {}, "status": 200}
    path.write_text(
        json.dumps({"seq": 1, **line}) + "\n" + '{"seq": 2, "us' + json.dumps({"seq": 3, **line})
    )
    path.write_text(path.read_text() + "\n" + '{"seq": 4, "user": "al')  # a crash mid-write
    log = AuditLog(tmp_path, max_bytes=1 << 20, keep=2)
    log.append({**line, "user": "bob"})
    entries, more, damaged = log.page_report(10)
    assert [e["seq"] for e in entries] == [4, 3, 1] and not more  # seq 4 was never written
    assert damaged == 2 and entries[0]["user"] == "bob"
