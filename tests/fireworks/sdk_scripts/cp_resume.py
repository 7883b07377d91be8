"""Resume a trainer job after a worker restart, through the official SDK.

    python cp_resume.py <job_id>

`TrainerJobManager.reconnect_and_wait`: the job reads PAUSED (a resumable state), `:resume`
loads it again, the SDK waits for RUNNING and healthz. Prints one JSON object.
"""

from __future__ import annotations

import json
import os
import sys

from fireworks.training.sdk.trainer import TrainerJobManager


def main() -> None:
    job_id = sys.argv[1]
    manager = TrainerJobManager(
        api_key=os.environ["FIREWORKS_API_KEY"], base_url=os.environ["FIREWORKS_BASE_URL"]
    )
    before = manager.get(job_id)["state"]
    endpoint = manager.reconnect_and_wait(job_id, poll_interval_s=0.2, timeout_s=120)
    after = manager.get(job_id)["state"]
    print(json.dumps({"before": before, "after": after, "base_url": endpoint.base_url}))


if __name__ == "__main__":
    main()
