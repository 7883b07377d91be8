"""What the attention sees during training: which function transformers dispatches to, what
shape and mask each call gets, and how often a dense `[rows, 1, L, L]` mask is built. Installed
in this process (the 1-process reference) and in every rank of `spmd_case attention`. The
load-time self-check (`trainer.compute.selfcheck.prove`, whose reference forward runs the
model's own SDPA) is not training: nothing is recorded while it runs."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from transformers.modeling_utils import AttentionInterface

from trainer.compute import selfcheck
from trainer.compute.batch import MicroBatch


@contextlib.contextmanager
def spy() -> Iterator[dict[str, Any]]:
    seen: dict[str, Any] = {"functions": [], "calls": [], "dense_masks": 0}
    get_interface = AttentionInterface.get_interface
    dense = MicroBatch.attention_mask_R_1_L_L
    prove = selfcheck.prove
    checking = [False]

    def quiet_prove(model: Any) -> Any:
        checking[0] = True
        try:
            return prove(model)
        finally:
            checking[0] = False

    def spied_get(self: Any, name: str, default: Callable[..., Any]) -> Callable[..., Any]:
        fn = get_interface(self, name, default)
        if checking[0]:
            return fn

        def attention(module: Any, query: Any, key: Any, value: Any, mask: Any, **kw: Any) -> Any:
            seen["calls"].append(
                {
                    "rows": int(query.shape[0]),
                    "tokens": int(query.shape[2]),
                    "mask": mask is not None,
                }
            )
            return fn(module, query, key, value, mask, **kw)

        label = f"{name}:{fn.__module__}.{fn.__qualname__}"
        if label not in seen["functions"]:
            seen["functions"].append(label)
        return attention

    def counted(batch: MicroBatch) -> Any:
        seen["dense_masks"] += 0 if checking[0] else 1
        return dense.fget(batch)  # type: ignore[attr-defined]

    selfcheck.prove = quiet_prove  # type: ignore[assignment]
    AttentionInterface.get_interface = spied_get  # type: ignore[method-assign]
    MicroBatch.attention_mask_R_1_L_L = property(counted)  # type: ignore[method-assign,assignment]
    try:
        yield seen
    finally:
        AttentionInterface.get_interface = get_interface  # type: ignore[method-assign]
        selfcheck.prove = prove  # type: ignore[assignment]
        MicroBatch.attention_mask_R_1_L_L = dense  # type: ignore[method-assign]
