"""Weights a cookbook user takes away: tinker-cookbook 0.6.1's own `weights.download` and
`weights.build_hf_model` on the worker's exports, on a tied model (`SDK_MODEL`, a Qwen3) and
an untied one (`UNTIED_MODEL`, a Llama), with `train_unembed` on (the SDK's default).

`sdk_scripts/weights_export.py` trains two steps and runs the cookbook; the checks here hold
its files against references computed here:
- the encrypted export, decrypted with the identity this test made, and the cookbook's
  download of the training checkpoint (its own temporary encrypted export) are byte for byte
  the plain export; no plaintext of an encrypted export is on the worker's disk;
- the plain export is our PEFT adapter in Tinker's naming (the head's LoRA under
  `model.unembed_tokens`), tensor for tensor;
- the cookbook's merge against our merged export (the MERGED variant) and a plain
  transformers + peft merge of our adapter, weights and logits, in fp32.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pyrage
import pytest
import torch
from safetensors.torch import load_file

from tests.api.conftest import LiveServer
from tests.tinker.conftest import SCRIPTS, SDK_MODEL, UNTIED_MODEL, run_in_venv
from trainer.api.tinker import paths
from trainer.api.tinker.records import TinkerCheckpoint
from trainer.checkpoint.export import is_encrypted
from trainer.checkpoint.store import INFERENCE
from trainer.serving.tenants import LOCAL

TIED = {SDK_MODEL: True, UNTIED_MODEL: False}
FILES = ["adapter_config.json", "adapter_model.safetensors"]

pytestmark = pytest.mark.filterwarnings(
    "ignore:Model (has|with) `tie_word_embeddings=True`:UserWarning"
)


@pytest.fixture(scope="module", params=[SDK_MODEL, UNTIED_MODEL])
def exported(
    request: pytest.FixtureRequest,
    venv_python: Path,
    tinker_server: LiveServer,
    served_models: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Any]:
    name = request.param
    identity = pyrage.x25519.Identity.generate()
    out_dir = tmp_path_factory.mktemp("weights")
    argv = [
        str(SCRIPTS / "weights_export.py"),
        name,
        str(served_models[name]),
        str(identity.to_public()),
        str(out_dir),
    ]
    out = run_in_venv(venv_python, tinker_server, argv, timeout=600)
    out.update(base_model=name, identity=identity, dir=out_dir)
    # our exports of the same weights, through the RL face's download of the sampler
    # checkpoint: the MERGED variant and the PEFT adapter
    record = paths.resolve(tinker_server.app.state.tinker, out["sampler"], "path", LOCAL)
    out["ours_merged"] = fetch_variant(tinker_server, record.id, "MERGED", out_dir / "ours")
    out["ours_adapter"] = fetch_variant(tinker_server, record.id, "ADAPTER", out_dir / "peft")
    return out


def fetch_variant(live: LiveServer, checkpoint_id: str, variant: str, dest: Path) -> Path:
    with live.client() as http:
        response = http.get(
            f"/rl/checkpoints/{checkpoint_id}/download",
            params={"variant": f"CHECKPOINT_VARIANT_{variant}"},
        )
        response.raise_for_status()
        dest.mkdir(parents=True)
        for entry in response.json()["data"]:
            (dest / entry["filename"]).write_bytes(httpx.get(entry["url"], timeout=60).content)
    return dest


def test_encrypted_exports_decrypt_to_the_plain_one(exported: dict[str, Any]) -> None:
    downloads = {k: Path(v) for k, v in exported["downloads"].items()}
    plain = {name: (downloads["plain"] / name).read_bytes() for name in FILES}
    assert sorted(p.name for p in downloads["plain"].iterdir()) == FILES
    sealed = sorted(p.name for p in downloads["sealed"].iterdir())
    assert sealed == [f"{name}.age" for name in FILES]
    stranger = pyrage.x25519.Identity.generate()
    for name in FILES:
        ciphertext = (downloads["sealed"] / f"{name}.age").read_bytes()
        assert ciphertext.startswith(b"age-encryption.org/v1\n")
        assert pyrage.decrypt(ciphertext, [exported["identity"]]) == plain[name]
        with pytest.raises(pyrage.DecryptError):
            pyrage.decrypt(ciphertext, [stranger])
        # the training checkpoint, through the cookbook's own temporary encrypted export
        assert (downloads["state"] / name).read_bytes() == plain[name]


def test_encrypted_exports_leave_no_plaintext(
    exported: dict[str, Any], tinker_server: LiveServer
) -> None:
    bridge = tinker_server.app.state.tinker
    store = tinker_server.worker.checkpoints
    record = paths.resolve(bridge, exported["sealed"], "path", LOCAL)
    files = sorted(p.relative_to(record.path).as_posix() for p in record.path.rglob("*"))
    assert files == [
        "adapter",
        *(f"adapter/{name}.age" for name in FILES),
        "manifest.json",
        "state.json",
    ]
    assert not any(store.tmp.iterdir())  # nothing staged in plaintext, nothing left over
    # the cookbook deleted its temporary export: its name and, encrypted, its files are gone
    left = exported["external_left"]
    assert exported["plain"] in left and exported["sealed"] in left
    assert not any(path.endswith("/external_weights/download") for path in left), left
    named = {c.checkpoint_id for c in bridge.db.select(TinkerCheckpoint)}
    for checkpoint in store.list(type=INFERENCE, limit=10_000):
        if is_encrypted(store.manifest(checkpoint.id)):
            assert checkpoint.id in named


def test_plain_export_is_our_adapter_in_tinker_naming(exported: dict[str, Any]) -> None:
    ours = load_file(str(exported["ours_adapter"] / FILES[1]))
    theirs = load_file(str(Path(exported["downloads"]["plain"]) / FILES[1]))
    head = "base_model.model.lm_head."
    unembed = "base_model.model.model.unembed_tokens."
    assert any(key.startswith(head) for key in ours)  # train_unembed: the SDK's default
    renamed = {(unembed + k[len(head) :] if k.startswith(head) else k): v for k, v in ours.items()}
    assert sorted(theirs) == sorted(renamed)
    for key, value in renamed.items():
        assert torch.equal(theirs[key], value), key
    config = json.loads((Path(exported["downloads"]["plain"]) / FILES[0]).read_text())
    peft_config = json.loads((exported["ours_adapter"] / FILES[0]).read_text())
    assert (config["r"], config["lora_alpha"]) == (peft_config["r"], peft_config["lora_alpha"])
    assert "unembed_tokens" in config["target_modules"]
    assert "lm_head" not in config["target_modules"]


def load(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def peft_models(base_dir: Path, adapter: Path) -> tuple[Any, Any]:
    """Plain peft on the base model: the adapter applied live, and merged in
    (`merge_and_unload`)."""
    from peft import PeftModel

    live = PeftModel.from_pretrained(load(base_dir), adapter).eval()
    merged = PeftModel.from_pretrained(load(base_dir), adapter).merge_and_unload().eval()
    return live, merged


def logits(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(tokens).logits.float()
    return out


def weights_of(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().float() for k, v in model.state_dict().items()}


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """fp32 agreement: the merges differ only in the order of float32 additions."""
    scale = float(want.abs().max()) or 1.0
    error = float((got - want).abs().max())
    assert error <= 1e-5 * max(scale, 1.0), f"{what}: max |diff| {error:.3g} (scale {scale:.3g})"


def test_build_hf_model_matches_our_merge(
    exported: dict[str, Any], served_models: dict[str, Path]
) -> None:
    base_dir = served_models[exported["base_model"]]
    base = load(base_dir)
    ours = load(exported["ours_merged"])
    cookbook = load(Path(exported["cookbook_merged"]))
    live, merged = peft_models(base_dir, exported["ours_adapter"])
    tokens = torch.tensor([[6, 11, 20, 7, 30, 12, 9, 25], [33, 8, 14, 6, 19, 27, 10, 31]])
    reference = logits(live, tokens)  # the trained model, the adapter applied live

    embed, head = "model.embed_tokens.weight", "lm_head.weight"
    b, o, c, m = (weights_of(x) for x in (base, ours, cookbook, merged))
    delta = o[head] - b[head]
    assert float(delta.abs().max()) > 1e-3  # the head's LoRA trained: its naming matters
    assert_close(logits(ours, tokens), reference, "our MERGED export")
    # the cookbook's merge equals plain peft's merge of our adapter, weight for weight
    assert sorted(c) == sorted(m)
    for key in m:
        assert_close(c[key], m[key], key)
    assert_close(logits(cookbook, tokens), logits(merged, tokens), "cookbook vs peft merge")
    for key in o:
        if key not in (embed, head):
            assert_close(c[key], o[key], key)
    assert_close(c[head], o[head], "the head")
    if TIED[exported["base_model"]]:
        # one matrix serves the input embedding and the head: a merge into it (the cookbook's,
        # peft's) moves the input embedding by the head's delta too; ours unties the head
        assert cookbook.config.tie_word_embeddings and not ours.config.tie_word_embeddings
        assert torch.equal(o[embed], b[embed])
        assert_close(c[embed], b[embed] + delta, "the tied embedding")
    else:
        assert_close(c[embed], o[embed], embed)
        assert_close(logits(cookbook, tokens), reference, "the cookbook's merge")


def test_build_lora_adapter_gives_back_our_peft_adapter(
    exported: dict[str, Any], served_models: dict[str, Path]
) -> None:
    """The cookbook's conversion of the export to PEFT (for vLLM and the like) loads with
    plain peft and computes the trained model, on an untied model. On a tied one it names the
    head's LoRA `model.embed_tokens` (the cookbook's mapping), which PEFT applies to the input
    embedding: `docs/semantics.md` §16."""
    if TIED[exported["base_model"]]:
        config = json.loads((Path(exported["cookbook_peft"]) / FILES[0]).read_text())
        assert "embed_tokens" in config["target_modules"]
        return
    base_dir = served_models[exported["base_model"]]
    tokens = torch.tensor([[6, 11, 20, 7, 30, 12, 9, 25]])
    live, _ = peft_models(base_dir, exported["ours_adapter"])
    theirs, _ = peft_models(base_dir, Path(exported["cookbook_peft"]))
    assert_close(logits(theirs, tokens), logits(live, tokens), "build_lora_adapter")
    ours = load_file(str(exported["ours_adapter"] / FILES[1]))
    converted = load_file(str(Path(exported["cookbook_peft"]) / FILES[1]))
    assert sorted(converted) == sorted(ours)
