"""Row 7, HTTP side: the `together` SDK drives `trainer serve` (a separate process) over TCP.

The server is started with the real CLI; the client creates a LoRA resource and session
through `together.post_training` and times `trainer.forward_backward(...)` end to end:
request encoding, HTTP, the operation queue, the engine, polling (every 20 ms) and decoding.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.arms_engine import batch_from
from benchmarks.engine_setup import ce_samples
from benchmarks.harness import Measurement, measure
from trainer import spawn

POLL_S = 0.02


@contextlib.contextmanager
def serve(model_dir: str, timeout: float = 120) -> Iterator[str]:
    """`python -m trainer serve` on a free loopback port; yields the API base URL."""
    port = spawn.free_port()
    storage = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [
        sys.executable, "-m", "trainer", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--storage", str(storage), "--model", f"bench={model_dir}", "--no-auth", "--device",
        "cpu", "--log-level", "warning",
    ]  # fmt: skip
    with spawn.serve(cmd, port, storage / "server.log", env=env, timeout=timeout, grace=30) as w:
        yield f"{w.url}/v1"


def http_fb_arm(params: dict[str, Any]) -> Measurement:
    from together.post_training import ModelResourcesClient

    samples: Any = [
        s.model_dump(mode="json", exclude_none=True) for s in ce_samples(batch_from(params))
    ]
    loss: Any = {"type": "LOSS_TYPE_CROSS_ENTROPY"}
    with (
        serve(params["model_dir"]) as api,
        ModelResourcesClient.create(
            api_key="bench",
            base_url=api,
            base_model="bench",
            lora_enabled=True,
            compute_config={"num_generator_replicas": 0},
            interval=POLL_S,
        ) as resource,
    ):
        session = resource.create_session(
            lora_config={"rank": params["rank"], "seed": 0}, interval=POLL_S
        )
        with session:
            trainer = session.trainer
            return measure(
                lambda: trainer.forward_backward(samples=samples, loss=loss),
                reps=params["reps"],
                warmup=params.get("warmup", 1),
            )
