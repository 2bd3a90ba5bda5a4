"""Process groups under `torchrun` and the few CPU collectives the trainer needs.

`init_distributed` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK): each
process owns device `cuda:LOCAL_RANK` (`torch.cuda.set_device`) on GPU; the default group
is NCCL for tensors on GPU (gloo on CPU), and a second gloo group carries CPU scalars,
metadata, barriers and checkpoint coordination, so no CPU tensor is ever sent over NCCL.
Every collective times out after `trainer.collective_timeout_s`.

Gradient reduction itself belongs to the data-parallel wrapper (`uniweave.train.distributed.parallel`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from uniweave.config import ConfigError


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    cpu_group: Any = field(default=None, compare=False)
    """gloo group for CPU collectives (None: the default group, itself gloo on CPU)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_distributed(
    device: torch.device, parallel: str, timeout_s: float
) -> tuple[DistInfo, torch.device]:
    """This process's place in the job and its device (module docstring).

    `trainer.parallel: none` runs one process (refused under torchrun with more than one);
    ddp/fsdp2 need torchrun (one process per device, any number of nodes)."""
    if not launched_by_torchrun() or (parallel == "none" and os.environ["WORLD_SIZE"] == "1"):
        if parallel != "none":
            raise ConfigError(
                f"trainer.parallel={parallel} needs torchrun (e.g. torchrun --nproc-per-node=N "
                "-m uniweave.cli train CONFIG)",
                key="trainer.parallel",
            )
        return DistInfo(), device
    if parallel == "none":
        raise ConfigError(
            f"trainer.parallel=none under torchrun with WORLD_SIZE={os.environ['WORLD_SIZE']}: "
            "set ddp or fsdp2",
            key="trainer.parallel",
        )
    local = int(os.environ.get("LOCAL_RANK", "0"))
    timeout = timedelta(seconds=timeout_s)
    cuda = device.type == "cuda"
    if cuda:
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if cuda else "gloo",
            timeout=timeout,
            device_id=device if cuda else None,
        )
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if cuda else None
    info = DistInfo(dist.get_rank(), dist.get_world_size(), local, cpu_group)
    return info, device


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(value: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum of the CPU tensor `value` over ranks (a copy; the input is left unchanged)."""
    out = value.clone()
    if info.enabled:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=info.cpu_group)
    return out


def all_gather_objects(value: Any, info: DistInfo) -> list[Any]:
    """`value` of every rank, in rank order (over the CPU group)."""
    if not info.enabled:
        return [value]
    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, value, group=info.cpu_group)
    return out


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier(group=info.cpu_group)
