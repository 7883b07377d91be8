"""The official `tinker` SDK (0.38, in its own venv) drives a LoRA model on the worker.

One SDK run (`sdk_scripts/train_sample.py`) covers capabilities, `get_info`, forward and
forward-backward with every served loss, a custom loss, optimizer steps, save/load state with
and without the optimizer, sampling after `save_weights_and_get_sampling_client`, and the REST
listing; the tests below check what it printed against references computed here:

- logprobs at LoRA init against a plain transformers forward of the served base model;
- each loss against its formula (docs/semantics.md) evaluated on the logprobs the call returned;
- resume against continuing (bit-exact), sampler logprobs against trainer logprobs (2e-3).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from tests.api.conftest import LiveServer, serve_in_thread
from tests.faults.procs import CE, ce_sample, forward_logprobs, new_resource, new_session, output
from tests.tinker.conftest import REPO, SCRIPTS, SDK_MODEL, catalogue, run_in_venv, tokenizer_of

LR = 1e-2  # train_sample.py's learning rate


@pytest.fixture(scope="module")
def downloads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("downloads")


@pytest.fixture(scope="module")
def run(venv_python: Path, tinker_server: LiveServer, downloads: Path) -> dict[str, Any]:
    script = str(SCRIPTS / "train_sample.py")
    return run_in_venv(venv_python, tinker_server, [script, SDK_MODEL, str(downloads)])


def arr(x: Any) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def loss_sum(metrics: dict[str, float]) -> float:
    assert "loss:sum" in metrics, metrics
    return float(metrics["loss:sum"])


def base_logprobs(
    model_dir: Path, data: list[dict], adapter: Path | None = None
) -> list[np.ndarray]:
    """log p(tokens[t+1] | tokens[:t+1]) from the served base model, by plain transformers
    (with a PEFT adapter on top when `adapter` is given)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).eval()
    out = []
    with torch.no_grad():
        for d in data:
            ids = torch.tensor([d["tokens"]])
            logits = model(ids[:, :-1]).logits.float()
            lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[0, :, 0]
            out.append(lp.double().numpy())
    return out


def test_capabilities_info_tokenizer(run: dict[str, Any], served_models: dict[str, Path]) -> None:
    assert SDK_MODEL in run["capabilities"]
    info = run["info"]
    assert info["model_name"] == SDK_MODEL and info["lora_rank"] == 4
    assert info["tokenizer_id"] == str(tokenizer_of(served_models, SDK_MODEL))
    # get_tokenizer() loaded what get_info's tokenizer_id names, offline
    assert run["tokenizer_roundtrip"] == "what is two plus three"


def test_forward_logprobs_match_transformers(
    run: dict[str, Any], served_models: dict[str, Path]
) -> None:
    reference = base_logprobs(served_models[SDK_MODEL], run["data"])
    for got, ref in zip(run["forward_all"], reference, strict=True):
        np.testing.assert_allclose(arr(got), ref, atol=1e-4)
    # cross entropy: logprobs where the weight is non-zero, loss = -sum(w * lp)
    fwd = run["forward_ce"]
    total = 0.0
    for d, lp, ref in zip(run["data"], fwd["logprobs"], reference, strict=True):
        w = arr(d["weights"])
        np.testing.assert_allclose(arr(lp)[w != 0], ref[w != 0], atol=1e-4)
        total += float(-(w * ref).sum())
    assert loss_sum(fwd["metrics"]) == pytest.approx(total, rel=1e-4)


def reference_loss(name: str, lp: np.ndarray, q: np.ndarray, a: np.ndarray, cfg: dict) -> float:
    """The formulas of docs/semantics.md (sum over tokens), all positions kept."""
    r = np.exp(lp - q)
    if name == "importance_sampling":
        return float(-(r * a).sum())
    if name == "ppo":
        lo, hi = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
        return float(-np.minimum(r * a, np.clip(r, lo, hi) * a).sum())
    if name == "cispo":
        lo, hi = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
        return float(-(np.clip(r, lo, hi) * a * lp).sum())
    if name == "dro":
        return float(-(a * lp - cfg["beta"] / 2 * (lp - q) ** 2).sum())
    if name == "gspo":  # the sequence ratio over positions 2.., where the advantages are
        s = np.exp(np.mean(lp[2:] - q[2:]))
        lo, hi = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
        return float(-np.minimum(s * a[2:], np.clip(s, lo, hi) * a[2:]).sum())
    raise AssertionError(name)


@pytest.mark.parametrize("name", ["importance_sampling", "ppo", "cispo", "dro", "gspo"])
def test_policy_losses_match_their_formulas(run: dict[str, Any], name: str) -> None:
    for key in (name, name + "/forward"):
        got = run["losses"][key]
        total = 0.0
        for lp, ref, q, a in zip(
            got["logprobs"], run["forward_all"], run["old"], run["adv"], strict=True
        ):
            # no optim step has run: forward-backward sees the weights forward saw
            np.testing.assert_allclose(arr(lp), arr(ref), atol=1e-5)
            total += reference_loss(name, arr(lp), arr(q), arr(a), run["config"][name] or {})
        assert loss_sum(got["metrics"]) == pytest.approx(total, rel=1e-4, abs=1e-5), key


def test_cross_entropy_and_custom(run: dict[str, Any]) -> None:
    ce = run["losses"]["cross_entropy"]
    assert loss_sum(ce["metrics"]) == pytest.approx(
        loss_sum(run["forward_ce"]["metrics"]), rel=1e-5
    )
    # a custom loss of 0.5 x cross entropy, computed by the SDK on the logprobs we returned
    custom = run["custom"]
    assert loss_sum(custom["metrics"]) == pytest.approx(0.5 * loss_sum(ce["metrics"]), rel=1e-4)
    assert custom["metrics"]["half_ce"] == pytest.approx(0.5 * loss_sum(ce["metrics"]), rel=1e-4)
    # the server's backward ran the linear surrogate -sum(dC/dlp * lp), which equals C here
    surrogate = custom["metrics"]["surrogate_loss:sum"]
    assert surrogate == pytest.approx(0.5 * loss_sum(ce["metrics"]), rel=1e-4)
    for lp, ref in zip(custom["logprobs"], ce["logprobs"], strict=True):
        np.testing.assert_allclose(arr(lp), arr(ref), atol=1e-5)


def test_refusals_name_the_loss_and_the_field(run: dict[str, Any]) -> None:
    # stable_reinforce datums without provenance (test_stable_reinforce.py covers the rest)
    assert run["stable_reinforce_error"] is not None
    assert (
        "data[0].model_input_spans: is required by stable_reinforce"
        in (run["stable_reinforce_error"])
    )
    assert run["bad_dro_error"] is not None and "beta" in run["bad_dro_error"]


def test_optim_step_and_bit_exact_resume(run: dict[str, Any]) -> None:
    # lr 0: weights untouched, bit for bit
    assert run["after_zero_step"] == run["forward_ce"]["logprobs"]

    # one cross-entropy step lowers the weighted NLL of the batch it was taken on
    def nll(logprobs: list[list[float]]) -> float:
        return sum(
            float(-(arr(d["weights"]) * arr(lp)).sum()) for d, lp in zip(run["data"], logprobs)
        )

    assert nll(run["after_step1"]) < nll(run["forward_ce"]["logprobs"]) - 1e-3
    # resume: the saved state reloads exactly, and the next step matches continuing, bit for bit
    assert run["reloaded_with_optimizer"] == run["after_step1"]
    assert run["resumed_with_optimizer"] == run["continued"]
    assert run["fresh_from_state"] == run["continued"]
    # weights only: same weights, fresh Adam moments, so the next step differs
    assert run["reloaded_weights_only"] == run["after_step1"]
    assert run["resumed_weights_only"] != run["continued"]
    assert "step1" in run["state1"] and run["state1"].startswith("tinker://")


def test_sampler_logprobs_match_trainer(run: dict[str, Any]) -> None:
    sample = run["sample"]
    prompt = sample["prompt"]
    n = len(prompt)
    assert len(sample["sequences"]) == 2
    for seq, rescored in zip(sample["sequences"], run["rescored"], strict=True):
        assert 1 <= len(seq["tokens"]) <= 6
        np.testing.assert_allclose(arr(seq["logprobs"]), arr(rescored[n - 1 :]), atol=2e-3)
    # prompt logprobs: none for the first token, then the trainer's
    plp = sample["prompt_logprobs"]
    assert len(plp) == n and plp[0] is None
    np.testing.assert_allclose(arr(plp[1:]), arr(run["rescored"][0][: n - 1]), atol=2e-3)
    # top-3 at each prompt position: sorted, at least as likely as the actual token
    topk = sample["topk_prompt_logprobs"]
    assert len(topk) == n
    for pos in range(1, n):
        row = topk[pos]
        values = [v for _, v in row]
        assert len(row) == 3 and values == sorted(values, reverse=True)
        assert values[0] >= plp[pos] - 2e-3
        for token, value in row:
            if token == prompt[pos]:
                assert value == pytest.approx(plp[pos], abs=2e-3)


def test_rest_lists_runs_and_checkpoints(run: dict[str, Any]) -> None:
    assert run["info"]["model_id"] in run["runs"]
    kinds = {(c["id"].split("/")[-1], c["type"]) for c in run["checkpoints"]}
    assert ("before", "training") in kinds and ("step1", "training") in kinds
    assert any(c["type"] == "sampler" for c in run["checkpoints"])
    for c in run["checkpoints"]:
        assert c["path"].startswith(f"tinker://{run['info']['model_id']}/")


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`:UserWarning")
def test_external_weights_download_through_signed_urls(
    run: dict[str, Any], served_models: dict[str, Path], downloads: Path
) -> None:
    """`save_weights_external` + `get_external_weights_urls`: the files come without the API
    key, in Tinker's naming (the head's LoRA is `model.unembed_tokens`); renamed to PEFT's
    `lm_head` here, they load with plain peft and give the trained model's logprobs."""
    external = run["external"]
    assert external["path"].startswith(f"tinker://{run['info']['model_id']}/")
    assert sorted(external["files"]) == ["adapter_config.json", "adapter_model.safetensors"]
    assert run["unsigned_status"] in (401, 403)
    peft_dir = downloads.parent / f"{downloads.name}-peft"
    peft_dir.mkdir(exist_ok=True)
    tensors = load_file(str(downloads / "adapter_model.safetensors"))
    head, unembed = "base_model.model.lm_head.", "base_model.model.model.unembed_tokens."
    assert any(k.startswith(unembed) for k in tensors) and not any("lm_head" in k for k in tensors)
    renamed = {
        (head + k[len(unembed) :] if k.startswith(unembed) else k): v for k, v in tensors.items()
    }
    save_file(renamed, str(peft_dir / "adapter_model.safetensors"))
    config = json.loads((downloads / "adapter_config.json").read_text())
    config["target_modules"] = [
        "lm_head" if t == "unembed_tokens" else t for t in config["target_modules"]
    ]
    (peft_dir / "adapter_config.json").write_text(json.dumps(config))
    reference = base_logprobs(served_models[SDK_MODEL], run["data"], adapter=peft_dir)
    for got, ref in zip(run["after_step1"], reference, strict=True):
        np.testing.assert_allclose(arr(got), ref, atol=1e-4)


def test_readme_example_runs(venv_python: Path, tinker_server: LiveServer) -> None:
    out = run_in_venv(
        venv_python,
        tinker_server,
        [str(REPO / "scripts" / "tinker_example.py"), "--model", SDK_MODEL, "--steps", "3"],
    )
    losses = out["losses"]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert out["checkpoint"].startswith("tinker://") and out["sample"]


ADAM = {
    "learning_rate": LR,
    "beta1": 0.9,
    "beta2": 0.95,
    "eps": 1e-12,  # tinker.AdamParams' defaults, which the SDK always sends
    "weight_decay": 0.0,
    "grad_clip_norm": 0.0,
}


def together_step(http: httpx.Client, sid: str, sequences: list[list[int]]) -> None:
    output(
        http, sid, "forward-backward", {"loss": CE, "samples": [ce_sample(s) for s in sequences]}
    )
    output(http, sid, "optim-step", {"adam_params": ADAM})


def test_checkpoints_resume_across_the_two_faces(
    venv_python: Path, served_models: dict[str, Path], tmp_path: Path
) -> None:
    rng = np.random.default_rng(5)
    sequences = [rng.integers(6, 34, size=9).tolist() for _ in range(2)]
    entry = catalogue(served_models, SDK_MODEL)
    with serve_in_thread(tmp_path / "storage", {}, model=entry) as live, live.client() as http:
        # Together: one step, a training checkpoint, then one more step
        sid = new_session(http, new_resource(http, SDK_MODEL), lora_config={"rank": 4, "seed": 0})
        together_step(http, sid, sequences)
        saved = output(http, sid, "training-checkpoint", {})["checkpoint"]["id"]
        at_saved = forward_logprobs(http, sid, sequences)
        together_step(http, sid, sequences)
        after_next = forward_logprobs(http, sid, sequences)

        out = run_in_venv(
            venv_python,
            live,
            [
                str(SCRIPTS / "interop.py"),
                SDK_MODEL,
                f"tinker://{sid}/weights/{saved}",
                json.dumps(sequences),
            ],
        )
        # Tinker resumed the Together checkpoint, optimizer included: same logprobs, same next step
        for got, want in zip(out["together_loaded"], at_saved, strict=True):
            np.testing.assert_allclose(arr(got), arr(want), atol=1e-6)
        for got, want in zip(out["together_stepped"], after_next, strict=True):
            np.testing.assert_allclose(arr(got), arr(want), atol=1e-6)

        # Together lists and resumes what Tinker saved
        listed = http.get("/rl/checkpoints", params={"type": "CHECKPOINT_TYPE_TRAINING"}).json()
        tinker_saved = [c for c in listed["data"] if c["id"] != saved]
        assert len(tinker_saved) == 1, listed
        assert tinker_saved[0]["base_model"] == SDK_MODEL and tinker_saved[0]["step"] == 1
        rid = new_resource(http, SDK_MODEL)
        resumed = new_session(http, rid, resume_from_checkpoint_id=tinker_saved[0]["id"])
        for got, want in zip(
            forward_logprobs(http, resumed, sequences), out["tinker_stepped"], strict=True
        ):
            np.testing.assert_allclose(arr(got), arr(want), atol=1e-6)
        # and downloads its sampler weights through a signed URL, no token
        inference = http.get("/rl/checkpoints", params={"type": "CHECKPOINT_TYPE_INFERENCE"}).json()
        assert len(inference["data"]) == 1, inference
        urls = http.get(
            f"/rl/checkpoints/{inference['data'][0]['id']}/download",
            params={"variant": "CHECKPOINT_VARIANT_ADAPTER"},
        ).json()
        files = urls.get("data") or urls.get("files")
        assert files, urls
