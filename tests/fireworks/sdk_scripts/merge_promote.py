"""The cookbook's `examples/tools/merge_lora_and_promote.py`, its own functions and order but
one: it reads `service.trainer_job_id` before any training client exists, which every SDK line
refuses ("SDK-managed service did not resolve trainer job id"), so here the LoRA client comes
first. Run by the cookbook venv's python from the cookbook tree (it imports `training`).

    python merge_promote.py <base_model> <adapter_dir> <rank> <output_model_id> <snapshot>

Prints one JSON object: the job id, the save's path and snapshot name, the checkpoint row the
example resolved, and the model it polled until READY `HF_BASE_MODEL`.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.getcwd(), "training", "examples", "tools"))

import merge_lora_and_promote as example
from fireworks.training.sdk import FireworksClient, TrainerJobManager
from training.utils import TrainerConfig
from training.utils.service import build_service_client


def main() -> None:
    base_model, adapter, rank, output_model_id, snapshot = sys.argv[1:6]
    api_key = os.environ["FIREWORKS_API_KEY"]
    base_url = os.environ["FIREWORKS_BASE_URL"]
    fw_client = FireworksClient(api_key=api_key, base_url=base_url)
    trainer_mgr = TrainerJobManager(api_key=api_key, base_url=base_url)
    service = build_service_client(
        api_key=api_key,
        base_url=base_url,
        additional_headers=None,
        base_model=base_model,
        tokenizer_model=None,
        max_lora_rank=int(rank),
        max_context_length=None,
        learning_rate=1e-5,
        trainer=TrainerConfig(timeout_s=300),
        cleanup_trainer_on_close=False,
    )
    try:
        policy = service.create_lora_training_client(base_model, rank=int(rank))
        job_id = service.trainer_job_id
        policy.load_adapter(adapter).result(timeout=300)
        save = policy.save_weights_for_sampler_ext(snapshot, checkpoint_type="merged_base")
        checkpoint = example._resolve_merged_checkpoint(fw_client, job_id, save.snapshot_name, 30)
        trainer_mgr.promote_checkpoint(
            name=checkpoint["name"], output_model_id=output_model_id, base_model=base_model
        )
        model = example._poll_model_until_ready(
            base_url, api_key, fw_client.account_id, output_model_id, 30
        )
    finally:
        service.close()
    out = {"job_id": job_id, "path": save.path, "snapshot": save.snapshot_name}
    print(json.dumps({**out, "checkpoint": checkpoint, "model": model}))


if __name__ == "__main__":
    main()
