"""Create a trainer job with the official SDK and wait for it (RUNNING + healthz).

    python cp_create.py <base_model> <lora_rank> <job_id>

Prints one JSON object.
"""

from __future__ import annotations

import json
import os
import sys

from fireworks.training.sdk.trainer import TrainerJobConfig, TrainerJobManager


def main() -> None:
    base_model, rank, job_id = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    manager = TrainerJobManager(
        api_key=os.environ["FIREWORKS_API_KEY"], base_url=os.environ["FIREWORKS_BASE_URL"]
    )
    config = TrainerJobConfig(base_model=base_model, lora_rank=rank, requested_job_id=job_id)
    endpoint = manager.create_and_wait(config, poll_interval_s=0.2, timeout_s=120)
    again = manager.create(  # the id exists: the SDK takes the 409 and reuses the job
        TrainerJobConfig(base_model=base_model, lora_rank=rank, requested_job_id=job_id)
    )
    print(
        json.dumps(
            {
                "job_id": endpoint.job_id,
                "again": again.job_id,
                "state": manager.get(job_id)["state"],
            }
        )
    )


if __name__ == "__main__":
    main()
