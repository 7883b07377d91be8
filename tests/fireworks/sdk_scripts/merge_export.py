"""A `merged_base` save at an export precision, with a decision calibration (SDK 1.2.30's
`export_precision` and `metadata`), then promoted, against the worker in FIREWORKS_BASE_URL.

    python merge_export.py <base_model> <adapter_dir> <rank> <model_id> <precision> <temperature>

A trainer job (`TrainerJobManager.create_and_wait`) whose LoRA client loads the PEFT adapter
(`load_adapter`), saves it `merged_base` at `precision` with a calibration of one `choice`
temperature, and promotes the save's `CHECKPOINT_TYPE_INFERENCE_BASE` row. Prints one JSON
object: the save's path, the checkpoint row and the promoted model.
"""

from __future__ import annotations

import json
import os
import sys

from fireworks.training.sdk import FiretitanServiceClient, FireworksClient
from fireworks.training.sdk.decision import DecisionCalibration, SamplerCheckpointMetadata
from fireworks.training.sdk.trainer import TrainerJobConfig, TrainerJobManager


def main() -> None:
    base_model, adapter, rank, model_id, precision, temperature = sys.argv[1:7]
    key, url = os.environ["FIREWORKS_API_KEY"], os.environ["FIREWORKS_BASE_URL"]
    manager = TrainerJobManager(api_key=key, base_url=url)
    endpoint = manager.create_and_wait(
        TrainerJobConfig(base_model=base_model, lora_rank=int(rank)),
        poll_interval_s=0.2,
        timeout_s=120,
    )
    service = FiretitanServiceClient(base_url=endpoint.base_url, api_key=key)
    trainer = service.create_training_client(base_model=base_model, lora_rank=int(rank))
    trainer.load_adapter(adapter).result()
    calibration = DecisionCalibration(temperature={"choice": float(temperature)})
    save = trainer.save_weights_for_sampler_ext(
        "export",
        checkpoint_type="merged_base",
        export_precision=precision,
        metadata=SamplerCheckpointMetadata(decision_calibration=calibration),
    )
    control = FireworksClient(api_key=key, base_url=url)
    rows = control.list_checkpoints(endpoint.job_id)
    (row,) = [r for r in rows if r.get("checkpointType") == "CHECKPOINT_TYPE_INFERENCE_BASE"]
    model = control.promote_checkpoint(
        name=row["name"], output_model_id=model_id, base_model=base_model
    )
    print(json.dumps({"path": save.path, "checkpoint": row, "model": model}))


if __name__ == "__main__":
    main()
