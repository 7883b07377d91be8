"""The Fireworks SDK's embedding calls (`forward_backward_custom(output=...)`,
`forward_backward_contrastive`; docs/semantics.md §27), run in its own venv on both SDK lines,
against plain transformers: each sequence alone through the model's decoder, pooled. And its
`lora_init_method` (§23)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from tests.api.conftest import LiveServer
from tests.fireworks.conftest import LLAMA, QWEN, SCRIPTS, run_fw
from tests.tinker import tinker_http as th

pytestmark = pytest.mark.fireworks

SEQS = [[3, 17, 22, 9, 27, 5], [8, 21, 33, 30, 12], [4, 19, 7], [11, 26, 14, 2, 31, 6, 20]]
B, TAU = 2, 0.05


def reference_vectors(model_dir: Path, pooling: str) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for seq in SEQS:
            hidden = model.get_decoder()(input_ids=torch.tensor([seq])).last_hidden_state[0]
            rows.append(hidden.mean(0) if pooling == "mean" else hidden[-1])
    return torch.stack(rows)


def info_nce(vectors: torch.Tensor) -> float:
    z = vectors / vectors.norm(dim=-1, keepdim=True)
    sim, t = z[:B] @ z[B:].T / TAU, torch.arange(B)
    return float(0.5 * (F.cross_entropy(sim, t) + F.cross_entropy(sim.T, t)))


@pytest.mark.parametrize(("model", "rank"), [(QWEN, 4), (LLAMA, 0)])
def test_sdk_embedding_calls_match_transformers(
    fw_python: Path, fw_server: LiveServer, fw_models: dict[str, Path], model: str, rank: int
) -> None:
    out = run_fw(
        fw_python, fw_server, [str(SCRIPTS / "dp_embed.py"), model, str(rank), json.dumps(SEQS)]
    )
    for pooling in ("mean", "last"):
        want = reference_vectors(fw_models[model], pooling)
        got = torch.tensor(out[f"vectors_{pooling}"])
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    unit = want / want.norm(dim=-1, keepdim=True)
    torch.testing.assert_close(torch.tensor(out["rows_last"]), unit @ unit.T, atol=2e-5, rtol=1e-4)
    loss = info_nce(want)
    assert out["client_loss"] == pytest.approx(loss, rel=1e-4)
    # the zero losses changed nothing, and the client's loss left no step: same weights
    assert out["contrastive"]["loss:sum"] == pytest.approx(loss, rel=1e-4), out["contrastive"]
    assert 0 <= out["contrastive"]["in_batch_recall_at_1:mean"] <= 1
    if "projection" in out:
        assert "projection head" in out["projection"], out["projection"]


def test_sdk_lora_init_method_nora(
    fw_python: Path, fw_server: LiveServer, fw_models: dict[str, Path]
) -> None:
    """`create_training_client(lora_init_method="nora")` (1.2.30; 1.2.9 has no such argument):
    the adapter's every A has unit columns over the rank; `kaiming`'s has not
    (docs/semantics.md §23)."""
    out = run_fw(fw_python, fw_server, [str(SCRIPTS / "dp_nora.py"), QWEN])
    if out.get("unsupported"):
        assert "1.2.9" in str(fw_python), fw_python
        return
    for method, unit in (("nora", True), ("kaiming", False)):
        session = th.engine_session(fw_server, out[method])
        norms = [
            torch.linalg.vector_norm(p.detach(), dim=0)
            for name, p in session.policy.trainable.items()
            if ".lora_A." in name
        ]
        assert norms and all(torch.allclose(n, torch.ones_like(n)) for n in norms) is unit
