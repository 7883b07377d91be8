"""The precision a merged model's files are written in (`export_precision`, docs/semantics.md
§23).

A merge is computed at the trainer's precision, then each floating tensor is rounded once to
the export's dtype (`torch.Tensor.to`, round to nearest even), except the tensors the model's
class keeps in float32 when it loads in that dtype (`_keep_in_fp32_modules_strict`, and in
float16 `_keep_in_fp32_modules` too; matched as transformers matches them), which keep the
trainer's. The config then names the dtype, so
`from_pretrained(dtype="auto")` reads the files as they are.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
DTYPES = {name: dtype for dtype, name in NAMES.items()}
EXPORTED = {"bf16": torch.bfloat16}  # `trainer.contract.exports.WRITTEN` but `source`


def stored_dtype(model_dir: Path) -> torch.dtype | None:
    """The dtype a model directory's `config.json` says its weights are stored in (`dtype`,
    else `torch_dtype`, else its `text_config`'s): what `from_pretrained(dtype="auto")`
    loads. None when it says none, or one that is not a float type."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for level in (config, config.get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            name = level.get(key)
            if isinstance(name, str):
                return DTYPES.get(name.removeprefix("torch."))
    return None


def kept_in_fp32(model: Any, dtype: torch.dtype) -> list[str]:
    """The patterns of the parameters `model`'s class keeps in float32 when it loads in
    `dtype`: those it keeps at any 16-bit dtype, and in float16 those it keeps there too."""
    names = ["_keep_in_fp32_modules_strict"]
    if dtype == torch.float16:
        names.append("_keep_in_fp32_modules")
    patterns: set[str] = set()
    for module in model.modules():
        for name in names:
            patterns.update(getattr(module, name, None) or ())
    return sorted(patterns)


def cast(
    state: dict[str, torch.Tensor], dtype: torch.dtype, keep: list[str]
) -> dict[str, torch.Tensor]:
    """`state`'s floating tensors rounded to `dtype`, those a `keep` pattern finds as they
    are (transformers' glob: `*` is any text, searched anywhere in the name)."""
    found = re.compile("|".join(f"(?:{p.replace('*', '.*')})" for p in keep)) if keep else None
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if not tensor.is_floating_point() or (found is not None and found.search(name)):
            out[name] = tensor
        else:
            out[name] = tensor.to(dtype)
    return out


def name_dtype(config: dict[str, Any], dtype: torch.dtype) -> None:
    """Set the dtype a config names, in place: its own, and each sub-model's config's (a
    composite's text and vision configs)."""
    subs = [v for v in config.values() if isinstance(v, dict) and "model_type" in v]
    for level in (config, *subs):
        level["dtype"] = NAMES[dtype]
        if "torch_dtype" in level:
            level["torch_dtype"] = NAMES[dtype]
