"""Communication between ranks: JSON commands over uint8 tensors (no pickle), the few
collectives the engine needs, joining a torchrun job with timeouts, and test-only faults."""

from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from trainer.contract.options import COLLECTIVE_TIMEOUT_S

log = logging.getLogger(__name__)

OP_TIMEOUT_ENV = "TRAINER_DIST_TIMEOUT_S"  # collectives inside an operation
DEFAULT_OP_TIMEOUT_S = COLLECTIVE_TIMEOUT_S
IDLE_TIMEOUT = datetime.timedelta(days=30)  # ranks ≠ 0 wait this long for the next command


@dataclass
class Comm:
    """This rank's view of the job, in four process groups:
    - `group` (NCCL on CUDA, gloo on CPU): tensors inside an operation (FSDP, gradients);
    - `control` (gloo, same timeout): small JSON and integers inside an operation;
    - `outcomes` (gloo, twice the timeout): each operation's outcome, exchanged on a group of
      its own so that a rank that failed early never meets another rank's in-op collective;
    - `commands` (gloo, long timeout): the next command, which may follow a long idle time."""

    rank: int
    world_size: int
    device: torch.device
    group: Any
    control: Any
    outcomes: Any
    commands: Any

    def broadcast_json(self, obj: Any = None, group: Any = None) -> Any:
        """Rank 0's `obj` on every rank."""
        group = group if group is not None else self.control
        size = torch.zeros(1, dtype=torch.int64)
        data = b""
        if self.rank == 0:
            data = json.dumps(obj).encode()
            size[0] = len(data)
        dist.broadcast(size, src=0, group=group)
        buffer = torch.empty(int(size[0]), dtype=torch.uint8)
        if self.rank == 0:
            buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        dist.broadcast(buffer, src=0, group=group)
        return json.loads(buffer.numpy().tobytes()) if self.rank != 0 else obj

    def all_gather_json(self, obj: Any, group: Any = None) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank."""
        group = group if group is not None else self.control
        data = json.dumps(obj).encode()
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=group)
        longest = max(int(s[0]) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        dist.all_gather(out, mine, group=group)
        return [json.loads(t[: int(s[0])].numpy().tobytes()) for t, s in zip(out, sizes)]

    def max_int(self, value: int) -> int:
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.control)
        return int(tensor[0])

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """In-place sum over ranks of a tensor on this rank's device."""
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor

    def broadcast_(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.broadcast(tensor, src=0, group=self.group)
        return tensor

    def barrier(self) -> None:
        dist.barrier(group=self.control)


def init_distributed(op_timeout_s: float | None = None) -> Comm:
    """Join the job described by torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...).

    `op_timeout_s` bounds every collective of an operation, so a dead or stuck rank fails the
    operation instead of hanging it; `trainer serve` passes `[distributed]
    collective_timeout_s`, other callers default to `$TRAINER_DIST_TIMEOUT_S` or 600.
    """
    if op_timeout_s is None:
        op_timeout_s = float(os.environ.get(OP_TIMEOUT_ENV, DEFAULT_OP_TIMEOUT_S))
    timeout = datetime.timedelta(seconds=op_timeout_s)
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout)
    outcomes = dist.new_group(backend="gloo", timeout=2 * timeout)
    commands = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return Comm(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        device=device,
        group=dist.group.WORLD,
        control=control,
        outcomes=outcomes,
        commands=commands,
    )


def is_distributed_launch() -> bool:
    """True under torchrun (or any launcher that sets WORLD_SIZE > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


LAUNCHER_POLL_S = 1.0  # how often a rank looks for its launcher
LAUNCHER_GRACE_S = 30.0  # from SIGTERM to SIGKILL once the launcher is gone


def leave_with_launcher(
    poll_s: float = LAUNCHER_POLL_S, grace_s: float = LAUNCHER_GRACE_S
) -> threading.Thread:
    """Stop this rank once the process that launched it (torchrun's agent) is gone.

    The agent normally stops its ranks itself; killed outright (SIGKILL, the OOM killer), it
    leaves them orphaned: rank 0 still holding the port and every rank its device. A daemon
    thread notices the new parent within `poll_s`, sends this process SIGTERM (rank 0 stops
    gracefully, the others exit), and SIGKILL if it is still alive `grace_s` later."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        log.warning("the launcher (pid %d) is gone: stopping this rank", parent)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="launcher-watch", daemon=True)
    thread.start()
    return thread
