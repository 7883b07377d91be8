"""`python -m trainer serve` as a real process: token rules, preload, SIGTERM, restart."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from api_helpers import SEQUENCES, ce_sample
from conftest import TOKEN, LiveServer, free_port, serve_in_thread, wait_status
from test_http import TERMINAL, run_op

from trainer.spawn import wait_healthy

REPO = Path(__file__).resolve().parents[2]


def _env(token: str | None = TOKEN) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRAINER_API_TOKEN"}
    env.update(HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    if token is not None:
        env["TRAINER_API_TOKEN"] = token
    return env


def _serve_args(storage: Path, model_dir: Path, port: int, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "trainer", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--storage", str(storage), "--model", f"tiny-qwen={model_dir}", "--device", "cpu", *extra,
    ]  # fmt: skip


@contextmanager
def worker_process(args: list[str]) -> Iterator[tuple[subprocess.Popen[bytes], httpx.Client]]:
    port = int(args[args.index("--port") + 1])
    proc = subprocess.Popen(args, env=_env(), cwd=REPO, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc.poll, timeout=60)
    except RuntimeError as exc:  # the worker exited: say why
        raise AssertionError(proc.stderr.read().decode() if proc.stderr else "") from exc
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=f"{base}/v1", headers=headers, timeout=60) as client:
        try:
            yield proc, client
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _terminate(proc: subprocess.Popen[bytes]) -> tuple[int, str]:
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    return proc.returncode, err.decode()


def test_refuses_to_start_without_a_token(tmp_path: Path) -> None:
    base = [sys.executable, "-m", "trainer", "serve", "--storage", str(tmp_path)]
    base += ["--model", "m=/nowhere"]
    no_token = subprocess.run(base, env=_env(None), cwd=REPO, capture_output=True, timeout=60)
    assert no_token.returncode == 2
    assert b"TRAINER_API_TOKEN" in no_token.stderr
    public = subprocess.run(
        [*base, "--no-auth", "--host", "0.0.0.0"], env=_env(None), cwd=REPO, capture_output=True
    )
    assert public.returncode == 2 and b"loopback" in public.stderr
    (tmp_path / "empty").write_text("\n")
    empty = subprocess.run(
        [*base, "--token-file", str(tmp_path / "empty")],
        env=_env(None),
        cwd=REPO,
        capture_output=True,
    )
    assert empty.returncode == 2 and b"empty" in empty.stderr


def test_sigterm_and_restart_keep_the_catalogue(tmp_path: Path, tiny_qwen_dir: Path) -> None:
    storage = tmp_path / "storage"
    (tmp_path / "resource.json").write_text(
        json.dumps({"id": "mr-pod", "base_model": "tiny-qwen", "inactive_timeout": 600})
    )
    (tmp_path / "session.json").write_text(
        json.dumps({"id": "ts-pod", "lora_config": {"rank": 4, "seed": 0}})
    )
    first = _serve_args(
        storage, tiny_qwen_dir, free_port(),
        "--resource", str(tmp_path / "resource.json"), "--session", str(tmp_path / "session.json"),
    )  # fmt: skip
    with worker_process(first) as (proc, http):
        assert "TOKEN" not in json.dumps(http.get("/rl/supported-models").json())
        wait_status(http, "/rl/training-sessions/ts-pod", "TRAINING_SESSION_STATUS_RUNNING")
        body = {"loss": {"type": "LOSS_TYPE_CROSS_ENTROPY"}, "samples": [ce_sample(SEQUENCES[0])]}
        run_op(http, "ts-pod", "forward-backward", body)
        run_op(http, "ts-pod", "optim-step", {"adam_params": {"learning_rate": 1e-2}})
        saved = run_op(http, "ts-pod", "training-checkpoint")["output"]["checkpoint"]
        # an operation in flight when SIGTERM arrives: it finishes or is abandoned, cleanly
        http.post(
            "/rl/training-sessions/ts-pod/operations/forward-backward",
            json=body,
            headers={"Idempotency-Key": str(uuid.uuid4())},
        )
        code, err = _terminate(proc)
        assert code == 0, err
        assert TOKEN not in err

    # The restart runs in-process (same storage, a new Worker): a second child process would
    # only add the interpreter's import time.
    with serve_in_thread(storage, {"tiny-qwen": tiny_qwen_dir}) as live, live.client() as http:
        listed = http.get("/rl/checkpoints", params={"session_id": "ts-pod"}).json()["data"]
        assert [c["id"] for c in listed] == [saved["id"]] and listed[0]["step"] == 1
        old = http.get("/rl/training-sessions/ts-pod").json()
        assert old["status"] == "TRAINING_SESSION_STATUS_STOPPED" and old["step"] == 1
        assert [c["id"] for c in old["training_checkpoints"]] == [saved["id"]]
        resource = http.get("/rl/model-resources/mr-pod").json()
        assert resource["status"] == "MODEL_RESOURCES_STATUS_STOPPED"
        rid = http.post("/rl/model-resources", json={"base_model": "tiny-qwen"}).json()["id"]
        wait_status(http, f"/rl/model-resources/{rid}", "MODEL_RESOURCES_STATUS_READY")
        resumed = http.post(
            "/rl/training-sessions",
            json={"model_resources_id": rid, "resume_from_checkpoint_id": saved["id"]},
        ).json()
        assert resumed["status"] == "TRAINING_SESSION_STATUS_RUNNING" and resumed["step"] == 1
        op = run_op(http, resumed["id"], "optim-step")
        assert op["status"] == TERMINAL[0] and op["output"]["step"] == 2


def test_sdk_example_script(server: LiveServer) -> None:
    script = REPO / "scripts" / "sdk_example.py"
    args = [sys.executable, str(script), "--base-url", server.api, "--model", "tiny-qwen"]
    done = subprocess.run([*args, "--rank", "4"], env=_env(), capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()
    out = done.stdout.decode()
    assert "step 2 | loss" in out and "adapter_model.safetensors" in out


def test_sighup_rereads_the_keys_file(tmp_path: Path, tiny_qwen_dir: Path) -> None:
    """`trainer serve --keys FILE`: a key removed from the file is refused once the process
    gets SIGHUP, the other keys still work; a malformed file fails the start naming its line."""
    import hashlib
    import secrets
    import time

    keys = {name: secrets.token_urlsafe(16) for name in ("alice", "bob")}

    def digest(name: str) -> str:
        return hashlib.sha256(keys[name].encode()).hexdigest()

    def write(*names: str) -> None:
        (tmp_path / "keys.toml").write_text(
            "".join(f'[[key]]\nuser = "{n}"\nsha256 = "{digest(n)}"\n' for n in names)
        )

    (tmp_path / "bad.toml").write_text('[[key]]\nuser = "a"\nsha256 = "zz"\n')
    args = _serve_args(
        tmp_path / "s", tiny_qwen_dir, free_port(), "--keys", str(tmp_path / "bad.toml")
    )
    bad = subprocess.run(args, env=_env(None), cwd=REPO, capture_output=True, timeout=60)
    assert bad.returncode == 2 and b"line 1" in bad.stderr and b"sha256" in bad.stderr
    write("alice", "bob")
    args = _serve_args(
        tmp_path / "s", tiny_qwen_dir, free_port(), "--keys", str(tmp_path / "keys.toml")
    )
    with worker_process(args) as (proc, _):
        base = args[args.index("--port") + 1]
        url = f"http://127.0.0.1:{base}/v1/rl/supported-models"

        def status(name: str) -> int:
            headers = {"Authorization": f"Bearer {keys[name]}"}
            return httpx.get(url, headers=headers, timeout=30).status_code

        assert status("alice") == 200 and status("bob") == 200
        write("alice")
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while status("bob") != 401:
            assert time.monotonic() < deadline, "bob's key still works after SIGHUP"
            time.sleep(0.1)
        assert status("alice") == 200 and proc.poll() is None
