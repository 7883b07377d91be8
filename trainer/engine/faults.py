"""Fault points for the tests: a named place where one rank can be made to die or raise."""

from __future__ import annotations

import logging
import os

import torch.distributed as dist

log = logging.getLogger(__name__)

FAULT_ENV = "TRAINER_DIST_FAULT"  # "RANK:POINT" makes that rank exit at POINT; ":raise" raises


def fault_point(name: str) -> None:
    """Tests only: `TRAINER_DIST_FAULT=RANK:NAME` makes that rank die here, as a crash would;
    `RANK:NAME:raise` makes it raise instead, as a bug would."""
    spec = os.environ.get(FAULT_ENV, "")
    if not spec or not dist.is_initialized():
        return
    rank, _, rest = spec.partition(":")
    point, _, mode = rest.partition(":")
    if rank != str(dist.get_rank()) or point != name:
        return
    log.error("fault injected at %s on rank %s", name, rank)
    if mode == "raise":
        raise RuntimeError(f"injected fault at {name}")
    os._exit(17)
