"""Drive a deployment through the Fireworks SDK's `DeploymentManager`.

    python dep_manage.py <base_model> <deployment_id> <identity> <trainer_job>

Steps, each result in the one JSON object printed at the end: `create_or_get` (twice: the
second finds it), `wait_for_ready`, `get`, the hot-load status before, `hotload` +
`wait_for_hotload` of `identity` (the `WeightSyncer` checks first: `wait_for_hotload_ready`,
`check_deployment_state`), the status after, `update` (transition type), `reattach_trainer`,
`scale_to_zero` and the status then, and last `delete` (then `get` is None).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from fireworks.training.sdk.deployment import DeploymentConfig, DeploymentManager


def main() -> None:
    base_model, dep_id, identity, job = sys.argv[1:5]
    key = os.environ["FIREWORKS_API_KEY"]
    mgr = DeploymentManager(api_key=key, base_url=os.environ["FIREWORKS_BASE_URL"])
    out: dict[str, Any] = {}
    config = DeploymentConfig(
        deployment_id=dep_id, base_model=base_model, deployment_shape="local", for_training=True
    )
    out["created"] = mgr.create_or_get(config).state
    ready = mgr.wait_for_ready(dep_id, timeout_s=120, poll_interval_s=0.5)
    out["ready"] = [ready.state, ready.inference_model, getattr(ready, "base_model", None)]
    out["again"] = mgr.create_or_get(config).name
    info = mgr.get(dep_id)
    assert info is not None
    out["get"] = [info.name, info.deployment_shape_version, info.hot_load_transition_type]
    out["before"] = mgr.hotload_check_status(dep_id, base_model)
    mgr.hotload(dep_id, base_model, identity)
    out["loaded"] = mgr.wait_for_hotload(
        dep_id, base_model, identity, timeout_seconds=120, poll_interval=1
    )
    out["after"] = mgr.hotload_check_status(dep_id, base_model)
    updated = mgr.update(
        dep_id, {"hotLoadTransitionType": "SYNC"}, update_mask=["hot_load_transition_type"]
    )
    out["updated"] = updated.hot_load_transition_type
    attached = mgr.reattach_trainer(
        dep_id, base_model=base_model, trainer_job_name=job, timeout_s=30, poll_interval_s=0.5
    )
    out["attached"] = [attached.state, attached.hot_load_trainer_job]
    mgr.scale_to_zero(dep_id)
    zero = mgr.get(dep_id)
    assert zero is not None
    out["zero"] = [zero.state, mgr.hotload_check_status(dep_id, base_model)]
    mgr.delete(dep_id)
    mgr._wait_for_deletion(dep_id, timeout_s=30, poll_interval_s=0.5)
    out["deleted"] = mgr.get(dep_id) is None
    print(json.dumps(out))


if __name__ == "__main__":
    main()
