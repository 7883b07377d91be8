"""The registry of measured code paths: arm name → function(params) → Measurement."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from benchmarks import arms_ckpt, arms_engine, arms_head, arms_http, arms_trl
from benchmarks.harness import Measurement, mark_base

ARMS: dict[str, Callable[[dict[str, Any]], Measurement]] = {
    "head": arms_head.head_arm,
    "mfu": arms_head.mfu_arm,
    "grpo_ours": arms_engine.grpo_ours_arm,
    "grpo_trl": arms_trl.grpo_trl_arm,
    "packing": arms_engine.packing_arm,
    "lora_sync": arms_engine.lora_sync_arm,
    "checkpoint": arms_ckpt.checkpoint_arm,
    "train_memory": arms_engine.train_memory_arm,
    "fb_inprocess": arms_engine.inprocess_fb_arm,
    "fb_http": arms_http.http_fb_arm,
}


def run_inprocess(arm: str, params: dict[str, Any]) -> Measurement:
    mark_base()
    return ARMS[arm](params)
