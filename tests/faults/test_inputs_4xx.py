"""Client input that used to reach a 5xx (or a FAILED INTERNAL_ERROR / an ERROR session) is a
4xx naming the field; payload uploads are safe under concurrent PUTs and after a session stops;
signed URLs survive a restart.

Every case goes over TCP to the real app and engine (`serve_in_thread`); nothing is mocked.
"""

from __future__ import annotations

import json
import os
import stat
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.conftest import LiveServer, serve_in_thread
from tests.faults.procs import (
    COMPLETED,
    ce_sample,
    model_input,
    new_resource,
    new_session,
    output,
    run_op,
)
from trainer.api.signing import KEY_FILE

HUGE = "9" * 5000  # past Python's 4,300-digit int() limit
UNICODE_DIGITS = ["²", "٣", "１２", "߂"]  # str.isdigit() is True for each; int() takes some


@pytest.fixture(scope="module")
def live(tiny_qwen_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    storage = tmp_path_factory.mktemp("inputs") / "storage"
    with serve_in_thread(storage, {"tiny-qwen": tiny_qwen_dir}) as server, server.client() as http:
        rid = new_resource(http, "tiny-qwen")
        sid = new_session(http, rid, lora_config={"rank": 2, "seed": 0})
        yield server, http, rid, sid


def _refused(response: httpx.Response, status: int, param: str) -> dict[str, Any]:
    assert response.status_code == status, (response.status_code, response.text[:500])
    error: dict[str, Any] = response.json()["error"]
    assert error["param"] == param, error
    assert param in error["message"], error
    return error


def _fingerprint(live: LiveServer, sid: str) -> tuple[int, dict[str, Any]]:
    session = live.worker.sessions[sid].engine
    return int(session.step), dict(session.policy_state())


# -- item 3: query, path and signed-URL parameters ------------------------------------------


@pytest.mark.parametrize(
    "route", ["/rl/model-resources", "/rl/training-sessions", "/rl/checkpoints"]
)
def test_limit_with_unicode_digits_or_5000_digits_is_400(live: Any, route: str) -> None:
    _, http, _, _ = live
    for bad in [*UNICODE_DIGITS, HUGE, "1" + "0" * 4400, "0", "101", "-1", "1.5", "1e2", "\0"]:
        _refused(http.get(route, params={"limit": bad}), 400, "limit")
    assert http.get(route, params={"limit": " 7 "}).status_code == 200
    assert http.get(route, params={"limit": "0100"}).status_code == 200


def test_signed_url_expires_and_sig_never_5xx(live: Any) -> None:
    _, http, _, sid = live
    upload = http.post(f"/rl/training-sessions/{sid}/payloads/upload-url").json()
    url = httpx.URL(upload["upload_url"])
    assert httpx.put(url, content=b'{"x": 1}').status_code == 200
    pid = upload["payload_id"]
    down = httpx.URL(
        http.post(f"/rl/training-sessions/{sid}/payloads/{pid}/download-url").json()["download_url"]
    )
    assert httpx.get(down).json() == {"x": 1}
    for bad in [*UNICODE_DIGITS, HUGE, "1" * 21, " 1", "-5", "0x10"]:
        _refused(httpx.get(down.copy_set_param("expires", bad)), 403, "expires")
        _refused(httpx.put(url.copy_set_param("expires", bad), content=b"{}"), 403, "expires")
    for bad in ["é" * 64, "\0" * 64, "Z" * 64, HUGE, down.params["sig"].upper()]:
        _refused(httpx.get(down.copy_set_param("sig", bad)), 403, "sig")
    _refused(httpx.get(down.copy_remove_param("sig")), 403, "sig")
    assert httpx.get(down).json() == {"x": 1}  # the genuine URL still works


# -- item 3: body values the engine cannot use ----------------------------------------------


def _post(http: httpx.Client, sid: str, kind: str, body: dict[str, Any] | bytes) -> httpx.Response:
    headers = {"Idempotency-Key": str(uuid.uuid4())}
    url = f"/rl/training-sessions/{sid}/operations/{kind}"
    if isinstance(body, bytes):
        headers["content-type"] = "application/json"
        return http.post(url, content=body, headers=headers)
    return http.post(url, json=body, headers=headers)


def _sample_body(**params: Any) -> dict[str, Any]:
    return {
        "model_inputs": [model_input([2, 3, 4, 5])],
        "num_samples": 2,
        "sampling_params": {"max_tokens": 6, **params},
    }


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"seed": 2**64}, "sampling_params.seed"),
        ({"seed": str(2**64)}, "sampling_params.seed"),
        ({"seed": str(2**63)}, "sampling_params.seed"),
        ({"seed": -(2**63) - 1}, "sampling_params.seed"),
        ({"seed": "٣"}, "sampling_params.seed"),
        ({"seed": HUGE[:4000]}, "sampling_params.seed"),
        ({"temperature": 1e-300}, "sampling_params.temperature"),
        ({"temperature": 5e-7}, "sampling_params.temperature"),
    ],
)
def test_sampling_values_the_engine_cannot_use_are_400(
    live: Any, params: dict[str, Any], param: str
) -> None:
    """These used to be queued and FAIL with INTERNAL_ERROR (`manual_seed` overflow, NaN
    probabilities): now a 400 before any operation exists, and nothing changes."""
    server, http, _, sid = live
    before = _fingerprint(server, sid)
    _refused(_post(http, sid, "sample", _sample_body(**params)), 400, param)
    assert _fingerprint(server, sid) == before


def test_sampling_seed_and_temperature_edges_work(live: Any) -> None:
    """The bounds are the wire's (int64) and the engine's: every int64 seed, as a number or a
    string, samples reproducibly; temperature 0 is greedy and 1e-6 (the smallest allowed)
    picks the same tokens."""
    _, http, _, sid = live

    def sequences(**params: Any) -> list[list[int]]:
        out = output(http, sid, "sample", _sample_body(**params))
        return [s["tokens"] for s in out["results"][0]["sequences"]]

    for seed in (2**63 - 1, str(2**63 - 1), -(2**63), "-1", "+0"):
        assert sequences(seed=seed) == sequences(seed=seed), seed
    assert sequences(seed="-1") == sequences(seed=-1)
    greedy = sequences(temperature=0.0, seed=1)
    assert greedy[0] == greedy[1]
    assert sequences(temperature=1e-6, seed=2) == greedy


@pytest.mark.parametrize(
    ("lora", "param"),
    [
        (b'{"rank": 2, "alpha": 1e400}', "lora_config.alpha"),
        ({"rank": 2, "alpha": 10**400}, "lora_config.alpha"),
        ({"rank": 2, "alpha": 2**16 + 1}, "lora_config.alpha"),
        ({"rank": 2, "seed": 2**64}, "lora_config.seed"),
        ({"rank": 2, "seed": "1" * 4400}, "lora_config.seed"),
        ({"rank": 2, "seed": "²"}, "lora_config.seed"),
    ],
)
def test_lora_values_the_engine_cannot_use_are_400(
    live: Any, lora: dict[str, Any] | bytes, param: str
) -> None:
    """These used to leave an ERROR session (seed overflow in `manual_seed`, alpha/rank
    overflowing a float): now a 400 and no session is recorded."""
    server, http, rid, _ = live
    before = len(server.worker.store.sessions_of(rid))
    if isinstance(lora, bytes):
        raw = b'{"model_resources_id": "%s", "lora_config": %s}' % (rid.encode(), lora)
        response = http.post(
            "/rl/training-sessions", content=raw, headers={"content-type": "application/json"}
        )
    else:
        response = http.post(
            "/rl/training-sessions", json={"model_resources_id": rid, "lora_config": lora}
        )
    _refused(response, 400, param)
    assert len(server.worker.store.sessions_of(rid)) == before


def test_lora_seed_edges_open_a_session(live: Any) -> None:
    _, http, rid, _ = live
    for seed in (2**63 - 1, str(-(2**63))):
        sid = new_session(http, rid, lora_config={"rank": 2, "alpha": 2**16, "seed": seed})
        assert output(
            http,
            sid,
            "forward-backward",
            {"loss": {"type": "LOSS_TYPE_CROSS_ENTROPY"}, "samples": [ce_sample([2, 3, 4, 5])]},
        )
        assert http.post(f"/rl/training-sessions/{sid}/stop").status_code == 200


def test_token_ids_as_strings_take_ascii_digits_only(live: Any) -> None:
    """`int("٣")` is 3 and `int("9" * 5000)` raises: neither may pass as a token id."""
    server, http, _, sid = live
    before = _fingerprint(server, sid)
    for bad in ["٣", "²", HUGE[:4400], "1" * 21]:
        body = _sample_body()
        body["model_inputs"] = [{"chunks": [{"encoded_text": {"tokens": ["2", bad]}}]}]
        response = _post(http, sid, "sample", body)
        assert response.status_code == 400, response.text[:300]
        assert response.json()["error"]["param"].startswith("model_inputs[0]")
    assert _fingerprint(server, sid) == before
    body = _sample_body()
    body["model_inputs"] = [{"chunks": [{"encoded_text": {"tokens": ["2", " 3", "+4"]}}]}]
    assert output(http, sid, "sample", body)["results"][0]["sequences"]


@pytest.mark.parametrize(
    ("location", "why"),
    [
        ("org/na\0me", "control characters"),
        ("/tmp/x\0y", "control characters"),
        ("a" * 5000, "at most"),
        ("org/" + "n" * 256, "component"),
        ("./" + "é" * 2100, "bytes"),
    ],
)
def test_resume_location_nul_and_long_names_are_400(live: Any, location: str, why: str) -> None:
    """`Path.exists()` raised ValueError (NUL) or OSError ENAMETOOLONG: a 500 before."""
    server, http, rid, _ = live
    before = len(server.worker.store.sessions_of(rid))
    body = {"model_resources_id": rid, "resume_from_hf_checkpoint": location}
    error = _refused(
        http.post("/rl/training-sessions", json=body), 400, "resume_from_hf_checkpoint"
    )
    assert why in error["message"]
    assert len(server.worker.store.sessions_of(rid)) == before


# -- item 10: PATCH metadata ----------------------------------------------------------------


def test_patch_refuses_unknown_metadata_and_validates_known(live: Any) -> None:
    _, http, _, sid = live
    url = f"/rl/training-sessions/{sid}"
    good = {"metadata": {"wandb": {"project": "p", "run_id": "r", "url": "https://wandb.ai/x"}}}
    assert http.patch(url, json=good).status_code == 200
    stored = http.get(url).json()["metadata"]
    assert stored == good["metadata"]
    for body, param in [
        ({"metadata": {"mlflow": {"run": "x"}}}, "metadata.mlflow"),
        ({"metadata": {"secret": "x" * 1000}}, "metadata.secret"),
        ({"metadata": {"wandb": {"bogus": "x"}}}, "metadata.wandb.bogus"),
        ({"metadata": {"wandb": {"project": 5}}}, "metadata.wandb.project"),
        ({"metadata": {"wandb": {"project": "a\0b"}}}, "metadata.wandb.project"),
        ({"metadata": {"wandb": {"run_name": "x" * 257}}}, "metadata.wandb.run_name"),
        ({"metadata": {"wandb": {"url": "javascript:alert(1)"}}}, "metadata.wandb.url"),
        ({"metadata": {"wandb": ["x"]}}, "metadata.wandb"),
    ]:
        _refused(http.patch(url, json=body), 400, param)
        assert http.get(url).json()["metadata"] == stored, body
    cleared = http.patch(url, json={"metadata": {"wandb": {"url": "", "group": "g"}}})
    assert cleared.json()["metadata"] == {"wandb": {"project": "p", "run_id": "r", "group": "g"}}


# -- items 4 and 10: payload uploads --------------------------------------------------------


def _payload_dir(server: LiveServer, sid: str) -> Path:
    return server.storage / "payloads" / sid


def _body(i: int, size: int) -> bytes:
    """A distinct JSON object of about `size` bytes."""
    return json.dumps({"writer": i, "fill": [i] * (size // 3)}).encode()


def _slow(data: bytes, chunk: int, pause: float) -> Iterator[bytes]:
    for start in range(0, len(data), chunk):
        yield data[start : start + chunk]
        time.sleep(pause)


def test_concurrent_puts_to_one_upload_url_store_one_whole_upload(live: Any) -> None:
    """8 clients PUT different ~1.5 MB bodies to one upload URL at once, in interleaved 64 KiB
    chunks. Before: they shared one `.part` file, one got a 500, and the stored file was a mix
    that was not JSON. Now every PUT is answered 200 and the stored payload is exactly one of
    the uploads (the last to complete), with no temporary file left."""
    server, http, _, sid = live
    upload = http.post(f"/rl/training-sessions/{sid}/payloads/upload-url").json()
    bodies = [_body(i, 1_500_000) for i in range(8)]
    statuses: list[int] = []

    def put(data: bytes) -> None:
        response = httpx.put(upload["upload_url"], content=_slow(data, 1 << 16, 0.002), timeout=120)
        statuses.append(response.status_code)

    threads = [threading.Thread(target=put, args=(b,)) for b in bodies]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert statuses == [200] * 8, statuses
    folder = _payload_dir(server, sid)
    assert not [p.name for p in folder.iterdir() if not p.name.endswith(".json")]
    stored = (folder / f"{upload['payload_id']}.json").read_bytes()
    assert stored in bodies
    json.loads(stored)
    # a retry of the same upload after that is one more whole write
    assert httpx.put(upload["upload_url"], content=bodies[3]).status_code == 200
    assert (folder / f"{upload['payload_id']}.json").read_bytes() == bodies[3]


def test_upload_after_stop_is_refused_and_recreates_nothing(live: Any) -> None:
    """After the session stops its payload directory is gone and stays gone: a PUT at a still
    valid URL is a 400 naming `session_id`, also when the PUT was already streaming as the
    session stopped."""
    server, http, rid, _ = live
    sid = new_session(http, rid, lora_config={"rank": 2, "seed": 0})
    late = http.post(f"/rl/training-sessions/{sid}/payloads/upload-url").json()["upload_url"]
    racing = http.post(f"/rl/training-sessions/{sid}/payloads/upload-url").json()["upload_url"]
    assert httpx.put(late, content=b'{"a": 1}').status_code == 200
    assert _payload_dir(server, sid).is_dir()

    answer: list[httpx.Response] = []
    streaming = threading.Event()

    def body() -> Iterator[bytes]:
        yield b'{"fill": ['
        streaming.set()
        for _ in range(40):
            time.sleep(0.05)
            yield b"1," * 1000
        yield b"1]}"

    put = threading.Thread(target=lambda: answer.append(httpx.put(racing, content=body())))
    put.start()
    assert streaming.wait(30)
    time.sleep(0.2)
    assert http.post(f"/rl/training-sessions/{sid}/stop").status_code == 200
    put.join(60)
    _refused(answer[0], 400, "session_id")
    assert not _payload_dir(server, sid).exists()
    _refused(httpx.put(late, content=b'{"a": 2}'), 400, "session_id")
    assert not _payload_dir(server, sid).exists()


# -- item 10: signed URLs across a restart --------------------------------------------------


def test_signed_urls_survive_a_restart(tiny_qwen_dir: Path, tmp_path: Path) -> None:
    storage = tmp_path / "storage"
    models = {"tiny-qwen": tiny_qwen_dir}
    with serve_in_thread(storage, models) as first, first.client() as http:
        sid = new_session(http, new_resource(http, "tiny-qwen"), lora_config={"rank": 2})
        ckpt = output(http, sid, "inference-checkpoint")["checkpoint"]["id"]
        files = http.get(
            f"/rl/checkpoints/{ckpt}/download", params={"variant": "CHECKPOINT_VARIANT_ADAPTER"}
        ).json()["data"]
        before = {f["filename"]: httpx.get(f["url"]).content for f in files}
    key = storage / KEY_FILE
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    secret = key.read_bytes()

    def on(server: LiveServer, url: str) -> httpx.URL:  # same path and query, new port
        return httpx.URL(url).copy_with(port=httpx.URL(server.url).port)

    with serve_in_thread(storage, models) as second:
        for entry in files:
            response = httpx.get(on(second, entry["url"]))
            assert response.status_code == 200, response.text
            assert response.content == before[entry["filename"]]
        assert second.app.state.signer.sign("h", "GET", "/p", now=0) == first.app.state.signer.sign(
            "h", "GET", "/p", now=0
        )
    assert key.read_bytes() == secret

    # an unreadable key is replaced (URLs signed with it die), a too-open one is tightened
    key.write_text("not hex")
    os.chmod(key, 0o644)
    with serve_in_thread(storage, models) as third:
        assert httpx.get(on(third, files[0]["url"])).status_code == 403
        assert third.app.state.signer.sign("h", "GET", "/p", now=0) != second.app.state.signer.sign(
            "h", "GET", "/p", now=0
        )
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert not [p for p in storage.iterdir() if p.name.endswith(".part")]


def test_failed_operation_after_refusals_is_not_created(live: Any) -> None:
    """A refused request records no operation: the catalogue has only the ones that ran."""
    server, http, _, sid = live
    key = str(uuid.uuid4())
    url = f"/rl/training-sessions/{sid}/operations/sample"
    refused = http.post(url, json=_sample_body(seed=2**64), headers={"Idempotency-Key": key})
    assert refused.status_code == 400
    assert server.worker.store.op_by_key(sid, key) is None
    op = run_op(http, sid, "sample", _sample_body(seed=7), key=key)  # the key is still free
    assert op["status"] == COMPLETED
