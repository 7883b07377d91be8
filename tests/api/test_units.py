"""Pure pieces of the HTTP layer, without a server: signing, catalogue, settings, errors."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from trainer.api.server import StartupError, resolve_token
from trainer.api.signing import UrlSigner
from trainer.cli import build_parser, serve_config
from trainer.serving.catalogue import (
    OP_FAILED,
    OP_RUNNING,
    RES_READY,
    RES_STOPPED,
    SES_RUNNING,
    SES_STOPPED,
    Catalogue,
    OperationRow,
    ResourceRow,
    SessionRow,
)
from trainer.serving.config import ServeConfig, is_loopback, overlay_models
from trainer.serving.errors import ApiError, field_path
from trainer.serving.payloads import PayloadFiles, offload_result
from trainer.serving.requests import overlay_metadata


def test_signer_binds_method_path_and_expiry() -> None:
    signer = UrlSigner(secret=b"k" * 32, ttl_s=60)
    url = signer.sign("http://h:1", "GET", "/v1/rl/files/x y", now=1000.0)
    assert url.startswith("http://h:1/v1/rl/files/x%20y?expires=1060&sig=")
    sig = url.rsplit("sig=", 1)[1]
    assert signer.verify("GET", "/v1/rl/files/x y", "1060", sig, now=1059) is None
    assert signer.verify("GET", "/v1/rl/files/x y", "1060", sig, now=1061) == "URL expired"
    assert signer.verify("PUT", "/v1/rl/files/x y", "1060", sig, now=1000) == "bad signature"
    assert signer.verify("GET", "/v1/rl/files/other", "1060", sig, now=1000) == "bad signature"
    assert signer.verify("GET", "/v1/rl/files/x y", "1061", sig, now=1000) == "bad signature"
    assert signer.verify("GET", "/p", None, sig) == "missing signature"
    assert signer.verify("GET", "/p", "12a", sig) == "malformed expiry"
    assert UrlSigner().sign("h", "GET", "/p") != UrlSigner().sign("h", "GET", "/p")


def test_store_pages_and_recovers(tmp_path: Path) -> None:
    store = Catalogue(tmp_path / "w.sqlite")
    for i in range(5):
        store.insert(ResourceRow(f"mr{i}", {"base_model": "m"}, RES_READY, float(i), float(i)))
    first, more = store.page(ResourceRow, after=None, limit=2)
    assert [r.id for r in first] == ["mr0", "mr1"] and more
    rest, more = store.page(ResourceRow, after="mr1", limit=10)
    assert [r.id for r in rest] == ["mr2", "mr3", "mr4"] and not more
    store.insert(SessionRow("ts", "mr0", {}, SES_RUNNING, 0.0, 0.0, step=3))
    store.insert(OperationRow("op", "ts", "optim-step", "k", "h", OP_RUNNING, 0.0, 0.0))
    store.update(ResourceRow, "mr4", status=RES_STOPPED)
    only, _ = store.page(ResourceRow, after=None, limit=10, statuses=[RES_STOPPED])
    assert [r.id for r in only] == ["mr4"]
    store.close()

    reopened = Catalogue(tmp_path / "w.sqlite")
    reopened.recover(time.time())
    assert reopened.get(ResourceRow, "mr0").status == RES_STOPPED  # type: ignore[union-attr]
    session = reopened.get(SessionRow, "ts")
    assert session is not None and session.status == SES_STOPPED and session.step == 3
    op = reopened.op_by_key("ts", "k")
    assert op is not None and op.status == OP_FAILED
    assert op.error is not None and op.error["code"].endswith("SESSION_NOT_ACTIVE")


def test_settings_from_toml_and_flags(tmp_path: Path) -> None:
    toml = tmp_path / "worker.toml"
    toml.write_text(
        'port = 9000\nstorage = "/srv"\n'
        '[[model]]\nname = "a"\nlocation = "org/a"\nmax_seq_length = 128\n'
    )
    args = build_parser().parse_args(
        [
            "serve",
            "--config",
            str(toml),
            "--port",
            "9001",
            "--model",
            "a=/local/a",
            "--model",
            "b=org/b",
        ]
    )
    config = serve_config(args)
    assert config.port == 9001 and config.storage == Path("/srv")
    assert [(m.name, m.location, m.max_seq_length) for m in config.models] == [
        ("a", "/local/a", 128),
        ("b", "org/b", 4096),
    ]
    with pytest.raises(ValueError, match="NAME=PATH"):
        overlay_models([], ["nameonly"])
    bad = tmp_path / "bad.toml"
    bad.write_text('storage = "/srv"\nprot = 1\n')
    with pytest.raises(ValueError, match="prot"):
        serve_config(build_parser().parse_args(["serve", "--config", str(bad)]))


def test_token_rules(tmp_path: Path) -> None:
    config = ServeConfig(storage=tmp_path)
    with pytest.raises(StartupError, match="TRAINER_API_TOKEN"):
        resolve_token(config, {})
    assert resolve_token(config, {"TRAINER_API_TOKEN": " t "}) == "t"
    (tmp_path / "tok").write_text("file-token\n")
    from_file = ServeConfig(storage=tmp_path, token_file=tmp_path / "tok")
    assert resolve_token(from_file, {"TRAINER_API_TOKEN": "env"}) == "file-token"
    assert resolve_token(ServeConfig(storage=tmp_path, no_auth=True), {}) is None
    public = ServeConfig(storage=tmp_path, no_auth=True, host="0.0.0.0")
    with pytest.raises(StartupError, match="loopback"):
        resolve_token(public, {})
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("10.0.0.1") and not is_loopback("example.com")


def test_field_paths() -> None:
    assert field_path(("body", "samples", 0, "loss_fn_inputs", "weights")) == (
        "samples[0].loss_fn_inputs.weights"
    )
    assert field_path(("query", "limit")) == "limit"
    assert field_path(()) == ""


def test_large_results_go_out_by_payload(tmp_path: Path) -> None:
    store = PayloadFiles(tmp_path, max_bytes=1 << 20)
    small = {"loss": 1.0, "metrics": {"m": 2.0}}
    assert offload_result(store, "ts", small, limit=1024) is small
    big = {"loss": 1.0, "metrics": {}, "loss_fn_outputs": [{"x": list(range(1000))}]}
    out = offload_result(store, "ts", big, limit=1024)
    assert set(out) == {"loss", "metrics", "payload_id"}
    assert store.read_json("ts", out["payload_id"]) == {"loss_fn_outputs": big["loss_fn_outputs"]}
    with pytest.raises(ApiError, match="malformed"):
        store.path("ts", "../../etc/passwd")


def test_patch_metadata_semantics() -> None:
    current = {"wandb": {"project": "p", "run_id": "r"}}
    assert overlay_metadata(current, {"wandb": {"project": "", "group": "g"}}) == {
        "wandb": {"run_id": "r", "group": "g"}
    }
    assert overlay_metadata(current, {}) == current


def test_token_and_signature_checks_are_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both credentials are compared with `hmac.compare_digest` (its time does not depend on
    where the first differing byte is): a plain `==` would leak the token byte by byte."""
    import asyncio
    import hashlib
    import hmac

    from starlette.requests import Request

    from trainer.api.auth import BearerAuth

    compared: list[tuple[bytes | str, bytes | str]] = []
    real = hmac.compare_digest

    def spy(a: bytes | str, b: bytes | str) -> bool:
        compared.append((a, b))
        return real(a, b)  # type: ignore[arg-type]

    monkeypatch.setattr(hmac, "compare_digest", spy)
    auth = BearerAuth("s3cret-token")
    for given, ok in (("s3cret-token", True), ("s3cret-tokem", False)):
        scope = {
            "type": "http",
            "headers": [(b"authorization", f"Bearer {given}".encode())],
        }
        if ok:
            asyncio.run(auth(Request(scope)))
        else:
            with pytest.raises(ApiError) as refused:
                asyncio.run(auth(Request(scope)))
            assert refused.value.status == 401
    # the key's sha256 against each key in force (`trainer.api.keys.KeyRing.identify`)
    want = hashlib.sha256(b"s3cret-token").digest()
    wrong = hashlib.sha256(b"s3cret-tokem").digest()
    assert compared == [(want, want), (wrong, want)]

    compared.clear()
    signer = UrlSigner(secret=b"k" * 32)
    url = signer.sign("http://h", "GET", "/f")
    query = dict(part.split("=", 1) for part in url.split("?", 1)[1].split("&"))
    assert signer.verify("GET", "/f", query["expires"], query["sig"]) is None
    assert signer.verify("GET", "/f", query["expires"], "0" * 64) is not None
    assert len(compared) == 2
