"""The precisions a merged model can be exported at, by the Fireworks SDK's names
(`save_weights_for_sampler(export_precision=...)`, docs/semantics.md §23): the ones the worker
writes, and the quantized ones it refuses. `trainer.compute.precision` maps the first to
dtypes."""

from __future__ import annotations

WRITTEN = ("source", "bf16")
QUANTIZED = ("nvfp4", "mxfp8", "fp8_block128")
