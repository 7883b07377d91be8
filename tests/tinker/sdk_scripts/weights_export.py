"""Train a LoRA a few steps and take its weights away with tinker-cookbook's `weights` helpers
(run by the tinker venv's python).

Usage: python weights_export.py BASE_MODEL BASE_MODEL_DIR AGE_RECIPIENT OUT_DIR
Env: TINKER_BASE_URL, TINKER_API_KEY (the SDK and the cookbook read them).

With `train_unembed` at the SDK's default (true): two cross-entropy steps, then
- `save_state` (a training checkpoint) and `save_weights_for_sampler` (our merged export's
  source);
- `save_weights_external` plain, and encrypted to AGE_RECIPIENT (the test holds its identity);
- `weights.download` of each: the plain export, the encrypted one (its `.age` files as they
  are), and the training checkpoint (the cookbook's own temporary encrypted export, decrypted
  with the key it made, then deleted);
- `weights.build_hf_model` and `weights.build_lora_adapter` from the training checkpoint's
  download onto BASE_MODEL_DIR.

Prints one JSON object with the paths; tests/tinker/test_weights_export.py checks the files.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import tinker
from tinker import types
from tinker_cookbook import weights

from tests.tinker.sdk_scripts.report import print_result

LR = 5e-2
RANK = 4


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def main(base_model: str, model_dir: Path, recipient: str, out_dir: Path) -> dict[str, Any]:
    rng = np.random.default_rng(7)
    data = [datum(rng.integers(6, 34, size=10).tolist()) for _ in range(3)]
    service = tinker.ServiceClient()
    training = service.create_lora_training_client(base_model=base_model, rank=RANK, seed=0)
    for _ in range(2):
        training.forward_backward(data, "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=LR)).result()
    out: dict[str, Any] = {"model_id": training.get_info().model_id}
    out["state"] = training.save_state("trained").result().path
    out["sampler"] = training.save_weights_for_sampler("trained").result().path
    out["plain"] = training.save_weights_external("plain").result().path
    out["sealed"] = (
        training.save_weights_external("sealed", age_encryption_recipients=[recipient])
        .result()
        .path
    )
    downloads = {}
    for name in ("plain", "sealed", "state"):
        target = out_dir / name
        weights.download(tinker_path=out[name], output_dir=str(target))
        downloads[name] = str(target)
    out["downloads"] = downloads
    merged = out_dir / "cookbook_merged"
    weights.build_hf_model(
        base_model=str(model_dir), adapter_path=downloads["state"], output_path=str(merged)
    )
    out["cookbook_merged"] = str(merged)
    converted = out_dir / "cookbook_peft"
    weights.build_lora_adapter(
        base_model=str(model_dir), adapter_path=downloads["state"], output_path=str(converted)
    )
    out["cookbook_peft"] = str(converted)
    # what the cookbook's download left behind: its temporary export is deleted
    rest = service.create_rest_client()
    listed = rest.list_user_checkpoints(limit=1000).result().checkpoints
    out["external_left"] = sorted(c.tinker_path for c in listed if c.checkpoint_type == "external")
    return out


if __name__ == "__main__":
    print_result(lambda: main(sys.argv[1], Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4])))
