"""AdamW, learning-rate schedules and gradient clipping.

Schedules (multiplier of the peak learning rate at update u, W warm-up updates, U total):
- constant:         1
- warmup_constant:  min(1, (u + 1) / W)
- warmup_cosine:    (u + 1) / W for u < W, then
                    r + (1 − r) · ½(1 + cos(π · (u − W) / max(1, U − W))), r = min_lr_ratio
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def lr_multiplier(
    update: int, schedule: str, warmup: int, total: int, min_lr_ratio: float = 0.0
) -> float:
    """The schedule's learning-rate multiplier at `update` (see module docstring)."""
    if schedule == "constant":
        return 1.0
    if warmup > 0 and update < warmup:
        return (update + 1) / warmup
    if schedule == "warmup_constant":
        return 1.0
    if schedule == "warmup_cosine":
        progress = min(1.0, (update - warmup) / max(1, total - warmup))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown scheduler {schedule!r}")


def build_scheduler(
    optimizer: torch.optim.Optimizer, schedule: str, warmup: int, total: int, min_lr_ratio: float
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda u: lr_multiplier(u, schedule, warmup, total, min_lr_ratio)
    )


def clip_gradients(params: Iterable[torch.nn.Parameter], max_norm: float) -> tuple[float, float]:
    """Clip the global L2 norm to `max_norm` (<= 0: no clipping).

    Returns (pre-clip norm, applied scale), the scale being min(1, max_norm / norm).
    """
    params = [p for p in params if p.grad is not None]
    norm = (
        torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(p.grad.detach().float()) for p in params])
        ).item()
        if params
        else 0.0
    )
    scale = 1.0
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in params:
            p.grad.mul_(scale)
    return norm, scale
