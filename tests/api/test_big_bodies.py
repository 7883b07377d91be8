"""Large request bodies: spooled, parsed off the event loop, bounded.

- A ~60 MB forward-backward body, inline or uploaded as a payload, is parsed in the body
  parser's child process: `/healthz` answers within 1.5 s all along (4.9 s when the worker
  parsed it itself) and the worker's resident set rises by less than 400 MiB (724 MiB before).
- Numbers decoded straight into arrays give bit-identical tensors, losses and logprobs to a
  plain `json.loads` of the same body.
- Nesting 100,000 deep and a 5,000-digit integer are 400s naming the field (they were 500s);
  a payload or an inline body over its cap is a 413 that leaves no file behind.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from conftest import LiveServer, serve_in_thread
from test_http import TERMINAL, new_resource, new_session, run_op

from benchmarks.bodies import HealthProbe, wire_body
from tests.faults.procs import rss_kib, serve_child
from trainer.compute.batch import prepare_samples
from trainer.serving.bodies import INLINE_MAX, BodyParser
from trainer.serving.jsonparse import BodyError
from trainer.serving.requests import ForwardBackwardBody

VOCAB = 128
PPO = {"type": "LOSS_TYPE_PPO"}
MIB = 1 << 20


def post(http: httpx.Client, sid: str, content: bytes, kind: str = "forward-backward") -> Any:
    return http.post(
        f"/rl/training-sessions/{sid}/operations/{kind}",
        content=content,
        headers={"Idempotency-Key": str(uuid.uuid4()), "content-type": "application/json"},
    )


def upload(http: httpx.Client, sid: str, content: bytes | Iterator[bytes]) -> tuple[str, Any]:
    """PUT `content` to a fresh signed upload URL: (payload_id, response)."""
    grant = http.post(f"/rl/training-sessions/{sid}/payloads/upload-url").json()
    return grant["payload_id"], httpx.put(grant["upload_url"], content=content, timeout=120)


def finish(http: httpx.Client, sid: str, op: dict[str, Any], kind: str = "forward-backward") -> Any:
    url = f"/rl/training-sessions/{sid}/operations/{kind}/{op['id']}"
    while op["status"] not in TERMINAL:
        time.sleep(0.05)
        op = http.get(url).json()
    return op


# -- 60 MB bodies against a real `trainer serve` process ---------------------------------------


@pytest.fixture(scope="module")
def big_body() -> dict[str, Any]:
    body = wire_body(2200, 500, seed=1, bad_last_target=True)  # ~60 MB of JSON
    return {"dict": body, "bytes": json.dumps(body).encode()}


@pytest.fixture(scope="module")
def worker(tiny_qwen_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    root = tmp_path_factory.mktemp("big-bodies")
    config = root / "worker.toml"
    config.write_text(
        f'max_body_bytes = {128 * MIB}\n\n[[model]]\nname = "tiny-qwen"\n'
        f'location = "{tiny_qwen_dir}"\nmax_batch_size = 4096\n'
        f"max_tokens_per_call = {1 << 22}\n"
    )
    with serve_child(root / "storage", {}, "--config", str(config)) as child:
        yield child


def test_a_60mb_body_leaves_health_and_memory_alone(worker: Any, big_body: dict[str, Any]) -> None:
    raw: bytes = big_body["bytes"]
    assert 55e6 < len(raw) < 66e6
    n, length = 2200, 500
    with worker.client() as http:
        sid = new_session(http, new_resource(http))
        warm = json.dumps(wire_body(40, 500, seed=2)).encode()  # 1.1 MB: starts the parser
        assert finish(http, sid, post(http, sid, warm).json())["status"] == TERMINAL[0]
        for mode in ("inline", "payload"):
            Path(f"/proc/{worker.pid}/clear_refs").write_text("5")  # reset the peak (VmHWM)
            before = rss_kib(worker.pid)
            with HealthProbe(worker.url) as probe:
                if mode == "inline":
                    response = post(http, sid, raw)
                else:
                    payload_id, put = upload(http, sid, raw)
                    assert put.status_code == 200, put.text
                    shrunk = {"loss": PPO, "payload_id": payload_id}
                    response = post(http, sid, json.dumps(shrunk).encode())
            peak = _peak_kib(worker.pid)
            # The edge saw the whole body: it names the last target of the last sample, which is
            # past the vocabulary.
            where = f"samples[{n - 1}].loss_fn_inputs.target_tokens[{length - 1}]"
            assert response.status_code == 400, response.text[:500]
            assert response.json()["error"]["param"] == where, response.text[:500]
            slowest = max(probe.latencies)
            assert len(probe.latencies) >= 10, (mode, probe.latencies)
            assert slowest < 1.5, f"{mode}: /healthz took {slowest:.2f} s"
            rise_mib = (peak - before) / 1024
            assert rise_mib < 400, f"{mode}: resident set rose by {rise_mib:.0f} MiB"


def _peak_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM")


# -- exactness, hostile JSON, caps: a worker in this process -----------------------------------


@pytest.fixture(scope="module")
def live(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with serve_in_thread(tmp_path_factory.mktemp("storage"), models) as server:
        yield server


@pytest.fixture(scope="module")
def http(live: LiveServer) -> Iterator[httpx.Client]:
    with live.client() as client:
        yield client


@pytest.fixture(scope="module")
def sid(http: httpx.Client) -> str:
    return new_session(http, new_resource(http))


def _tricky(n: int) -> list[float]:
    """Floats whose float32 rounding is easy to get wrong: 17 significant digits, halfway
    cases between float32 neighbours (double rounding), subnormals, -0.0, integers."""
    rng = np.random.default_rng(7)
    halfway = (1.0 + 2.0**-24) * 2.0 ** rng.integers(-20, 20, size=n)  # ties between floats
    values = np.concatenate(
        [rng.normal(size=n) * 3, halfway, np.nextafter(halfway, 0), [-0.0, 5e-324, 1e-40]]
    )
    return [float(v) for v in values]


def test_packed_arrays_are_bit_identical_to_json_loads() -> None:
    """Tensors from the packed path equal those from `json.loads` lists and the old formula."""
    body = wire_body(3, 60, seed=3)
    tricky = _tricky(20)[:60]
    body["samples"][0]["loss_fn_inputs"]["advantages"]["data"] = tricky
    body["samples"][1]["loss_fn_inputs"]["mask"]["data"] = [1, 0] * 30  # ints in float data
    raw = json.dumps(body).encode()
    reference = ForwardBackwardBody.model_validate(json.loads(raw))
    packed = ForwardBackwardBody.model_validate(_child_parse(raw))
    assert isinstance(packed.samples[0].loss_fn_inputs["advantages"].data, np.ndarray)
    assert isinstance(reference.samples[0].loss_fn_inputs["advantages"].data, list)
    new = prepare_samples(packed.samples, vocab_size=VOCAB, max_seq_length=512, max_batch_size=8)
    ref = prepare_samples(reference.samples, vocab_size=VOCAB, max_seq_length=512, max_batch_size=8)
    for a, b, listed in zip(new, ref, reference.samples, strict=True):
        assert torch.equal(a.tokens_T, b.tokens_T) and torch.equal(a.targets_T, b.targets_T)
        assert a.inputs.keys() == b.inputs.keys()
        for name, tensor in a.inputs.items():
            assert torch.equal(tensor.view(torch.int32), b.inputs[name].view(torch.int32)), name
            old = torch.tensor(
                [float(v) for v in listed.loss_fn_inputs[name].data], dtype=torch.float32
            )  # what the engine did before arrays: Python floats, then float32
            if name != "weights":
                assert torch.equal(tensor.view(torch.int32), old.view(torch.int32)), name
    assert packed.model_dump(mode="json") == reference.model_dump(mode="json")


def _child_parse(raw: bytes) -> dict[str, Any]:
    parser = BodyParser(Path(os.environ.get("TMPDIR", "/tmp")) / f"bodies-{uuid.uuid4().hex}",
                        inline_max=0)  # fmt: skip
    path = parser.spool_path()
    path.write_bytes(raw)
    try:
        return parser.parse_file(path, pack=True)
    finally:
        parser.close()
        path.unlink()
        path.parent.rmdir()


def test_http_results_equal_through_every_path(
    live: LiveServer, http: httpx.Client, sid: str
) -> None:
    """Loss, metrics and per-token logprobs are the same, to the bit, whether the body was
    decoded in a thread into lists, or packed into arrays by the child, inline or uploaded."""
    body = wire_body(6, 120, seed=4)
    body["samples"][0]["loss_fn_inputs"]["advantages"]["data"] = _tricky(40)[:120]
    body |= {"forward_only": True, "return_loss_fn_outputs": True}
    raw = json.dumps(body).encode()
    parser = live.worker.payloads.parser
    outputs = []
    try:
        for inline_max in (1 << 30, 0):  # lists decoded in a thread; arrays from the child
            parser.inline_max = inline_max
            inline = finish(http, sid, post(http, sid, raw).json())
            payload_id, put = upload(http, sid, raw)
            assert put.status_code == 200
            shrunk = json.dumps({"loss": PPO, "payload_id": payload_id}).encode()
            uploaded = finish(http, sid, post(http, sid, shrunk).json())
            outputs += [inline["output"], uploaded["output"]]
    finally:
        parser.inline_max = INLINE_MAX
    assert all(out == outputs[0] for out in outputs), outputs
    assert len(outputs[0]["loss_fn_outputs"]) == 6
    # and a training step through the child counts every sample: 6 x 60 masked-in tokens
    parser.inline_max = 0
    try:
        trained = finish(http, sid, post(http, sid, json.dumps(wire_body(6, 120)).encode()).json())
    finally:
        parser.inline_max = INLINE_MAX
    assert trained["status"] == TERMINAL[0], trained
    assert trained["output"]["metrics"]["loss/tokens"] == 6 * 60


def _deep(depth: int) -> bytes:
    return b'{"loss": {"type": "LOSS_TYPE_PPO"}, "samples": ' + b"[" * depth + b"]" * depth + b"}"


def _long_int(digits: int) -> bytes:
    body = wire_body(1, 4)
    text = json.dumps(body).replace('"tokens": [', '"tokens": [' + "7" * digits + ", ", 1)
    return text.encode()


@pytest.mark.parametrize("route", ["inline", "spooled", "payload"])
def test_hostile_json_is_a_400_naming_the_field(
    live: LiveServer, http: httpx.Client, sid: str, route: str
) -> None:
    parser = live.worker.payloads.parser
    cases = [
        (_deep(100_000), "samples" + "[0]" * 63, "nested deeper than 64 levels"),
        (_deep(70), "samples" + "[0]" * 63, "nested deeper than 64 levels"),  # orjson takes it
        (_long_int(5000), "samples[0].model_input.chunks[0].encoded_text.tokens[0]", "int64"),
        (_long_int(20), "samples[0].model_input.chunks[0].encoded_text.tokens[0]", "int64"),
    ]
    parser.inline_max = 0 if route == "spooled" else INLINE_MAX
    try:
        for raw, field, words in cases:
            if route == "payload":
                payload_id, put = upload(http, sid, raw)
                assert put.status_code == 200
                response = post(http, sid, json.dumps({"payload_id": payload_id}).encode())
            else:
                response = post(http, sid, raw)
            assert response.status_code == 400, (route, response.text[:300])
            error = response.json()["error"]
            assert error["param"] == field, (route, error)
            assert words in error["message"] and error["message"].startswith(field), error
    finally:
        parser.inline_max = INLINE_MAX
    assert run_op(http, sid, "forward-backward", wire_body(1, 8))["status"] == TERMINAL[0]


def test_bodies_over_their_cap_are_413_and_leave_no_file(
    live: LiveServer, http: httpx.Client
) -> None:
    sid = new_session(http, new_resource(http))
    payloads = live.worker.payloads
    cap, payloads.max_bytes = payloads.max_bytes, 64 * 1024
    try:
        declared = upload(http, sid, b" " * (100 * 1024))[1]  # Content-Length: refused early
        streamed = upload(http, sid, iter([b" " * 16 * 1024] * 8))[1]  # chunked: mid-stream
        fits = upload(http, sid, json.dumps(wire_body(1, 8)).encode())[1]
    finally:
        payloads.max_bytes = cap
    assert declared.status_code == 413 and streamed.status_code == 413, streamed.text
    assert fits.status_code == 200
    files = sorted(p.name for p in (payloads.root / sid).iterdir())
    assert files == [f"{fits.json()['payload_id']}.json"], files
    # an inline body past max_body_bytes, streamed without a length, while being spooled
    limit = live.worker.config.max_body_bytes
    response = http.post(
        f"/rl/training-sessions/{sid}/operations/forward-backward",
        content=iter([b" " * MIB] * (limit // MIB + 2)),
        headers={"Idempotency-Key": str(uuid.uuid4())},
    )
    assert response.status_code == 413, response.text
    assert list(payloads.parser.spool_dir.iterdir()) == []


def test_a_dead_parser_is_a_507_then_restarted(tmp_path: Path) -> None:
    """Killed mid-parse (what the kernel's OOM killer does) the body is a 507, not a hang;
    the next body starts a fresh child."""
    parser = BodyParser(tmp_path / "bodies", inline_max=0)
    path = tmp_path / "big.json"
    path.write_bytes(json.dumps(wire_body(800, 500)).encode())  # ~22 MB: about a second
    errors: list[BodyError] = []

    def parse() -> None:
        try:
            parser.parse_file(path, pack=True)
        except BodyError as exc:
            errors.append(exc)

    thread = threading.Thread(target=parse)
    thread.start()
    deadline = time.monotonic() + 30
    while parser._proc is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert parser._proc is not None
    time.sleep(0.2)
    os.kill(parser._proc.pid, signal.SIGKILL)
    thread.join(60)
    assert [e.kind for e in errors] == ["memory"], errors
    small = tmp_path / "small.json"
    small.write_bytes(json.dumps(wire_body(2, 8)).encode())
    assert len(parser.parse_file(small, pack=True)["samples"]) == 2
    parser.close()
    assert list((tmp_path / "bodies").iterdir()) == []
