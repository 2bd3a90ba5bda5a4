"""Process-group set-up for `torchrun` and the few collectives the trainer needs.

Data parallelism is explicit: each rank computes gradients of its shard of the global
batch under a *global* normaliser, and the gradients are summed across ranks (gloo on
CPU, NCCL on GPU), so the N-process objective equals the single-process one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed(device: str) -> DistInfo:
    """Initialise the default process group when launched by torchrun (WORLD_SIZE > 1)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    if not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend=backend)
    return DistInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
    )


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(value: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum of `value` over ranks (a copy; the input is left unchanged)."""
    out = value.clone()
    if info.enabled:
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def sum_gradients(params: list[torch.nn.Parameter], info: DistInfo) -> None:
    """Sum parameter gradients across ranks in one flat buffer (in place).

    A parameter a rank's shard did not reach gets a zero gradient first, so every rank
    contributes a buffer of the same layout.
    """
    if not info.enabled:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()
