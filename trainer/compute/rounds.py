"""A call's micro-batches over ranks: each rank's share of the samples, the empty micro-batch
a rank runs when it has none left (so every rank runs the same collectives), and the call's
result from every rank's report. In one process there is one share and one report."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from trainer.compute.batch import MicroBatch, PreparedSample, pack

Sums = dict[str, list[float]]  # metric name -> [numerator, denominator]


def split_by_tokens(samples: list[PreparedSample], world_size: int) -> list[list[PreparedSample]]:
    """Balance tokens: longest first, each to the rank holding the fewest tokens so far."""
    shares: list[list[PreparedSample]] = [[] for _ in range(world_size)]
    tokens = [0] * world_size
    for sample in sorted(samples, key=lambda s: (-s.length, s.index)):
        rank = min(range(world_size), key=lambda r: (tokens[r], r))
        shares[rank].append(sample)
        tokens[rank] += sample.length
    return [sorted(share, key=lambda s: s.index) for share in shares]


def empty_batch() -> MicroBatch:
    """One masked token: runs every FSDP unit, contributes nothing."""
    one = torch.zeros(1, dtype=torch.long)
    sample = PreparedSample(index=0, tokens_T=one, targets_T=one, mask_T=torch.zeros(1))
    return pack([sample])[0]


def new_sums() -> Sums:
    return defaultdict(lambda: [0.0, 0.0])


def add_metrics(
    sums: Sums,
    metrics: dict[str, tuple[float, float]],
    entropy_P: torch.Tensor | None = None,
) -> None:
    """Add a micro-batch's (numerator, denominator) metrics, and its entropy, to the call's."""
    for name, (num, den) in metrics.items():
        sums[name][0] += num
        sums[name][1] += den
    if entropy_P is not None:
        sums["loss/entropy/mean"][0] += float(entropy_P.sum())
        sums["loss/entropy/mean"][1] += float(entropy_P.numel())


Outputs = dict[int, list[Any]]
"""Call-level sample index -> its logprobs: `[T]` floats, or `[T][K]` for soft targets."""


def collect_outputs(batch: MicroBatch, logprobs_P: torch.Tensor, outputs: Outputs) -> None:
    """Each sample's logprobs at every position (0 where not kept: masked, unless the sample
    keeps every position; a whole row of K for soft targets), by call-level index."""
    offset = 0
    for sample in batch.samples:
        kept = sample.kept_T
        n = int(kept.sum())
        full = logprobs_P.new_zeros((sample.length, *logprobs_P.shape[1:]))
        full[kept] = logprobs_P[offset : offset + n]
        outputs[sample.index] = full.tolist()
        offset += n


def sum_reports(reports: list[dict[str, Any]]) -> tuple[float, Sums, Outputs]:
    """Sum the ranks' losses and metric (numerator, denominator) pairs, in rank order, and
    collect their per-sample outputs."""
    sums = new_sums()
    outputs: Outputs = {}
    for report in reports:
        for name, (num, den) in report["sums"].items():
            sums[name][0] += num
            sums[name][1] += den
        outputs.update({int(k): v for k, v in report["outputs"].items()})
    return sum(float(report["loss"]) for report in reports), sums, outputs


def call_result(
    total: float,
    sums: Sums,
    outputs: Outputs | None,
    norm: Any,
) -> dict[str, Any]:
    """The call's result from its summed loss, metric (numerator, denominator) pairs and
    per-sample logprobs (soft targets': flat row-major data with `shape` [T, K])."""
    metrics = {name: (num / den if den else 0.0) for name, (num, den) in sums.items()}
    metrics["loss/tokens"] = norm.total_mask
    result: dict[str, Any] = {"loss": total, "metrics": metrics}
    if outputs is not None:
        result["loss_fn_outputs"] = [
            {"tensors": {"logprobs": _tensor(outputs[i])}} for i in sorted(outputs)
        ]
    return result


def _tensor(values: list[Any]) -> dict[str, Any]:
    if not values or not isinstance(values[0], list):
        return {"data": values, "dtype": "float32"}
    flat = [v for row in values for v in row]
    return {"data": flat, "dtype": "float32", "shape": [len(values), len(values[0])]}
