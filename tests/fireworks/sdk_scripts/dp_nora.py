"""The Fireworks SDK's `create_training_client(lora_init_method=...)` on the worker.

    python dp_nora.py <base_model>

Prints one JSON object: the model id of a `nora` and of a `kaiming` LoRA model (rank 4, seed
0), or `unsupported` where the SDK line has no `lora_init_method`.
"""

from __future__ import annotations

import inspect
import json
import os
import sys

from fireworks.training.sdk.client import FiretitanServiceClient


def main() -> None:
    base_model = sys.argv[1]
    out: dict[str, str] = {}
    create = FiretitanServiceClient.create_training_client
    if "lora_init_method" not in inspect.signature(create).parameters:
        print(json.dumps({"unsupported": True}))
        return
    for method in ("nora", "kaiming"):  # one service per client: the SDK keys them by config
        service = FiretitanServiceClient(
            base_url=os.environ["FIREWORKS_BASE_URL"], api_key=os.environ["FIREWORKS_API_KEY"]
        )
        client = service.create_training_client(
            base_model=base_model, lora_rank=4, seed=0, lora_init_method=method
        )
        out[method] = client.model_id
    print(json.dumps(out))


if __name__ == "__main__":
    main()
