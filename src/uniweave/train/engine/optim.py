"""AdamW, learning-rate schedules and gradient clipping.

Schedules (multiplier of the peak learning rate at update u, W warm-up updates, U total):
- constant:         1
- warmup_constant:  min(1, (u + 1) / W)
- warmup_cosine:    (u + 1) / W for u < W, then
                    r + (1 − r) · ½(1 + cos(π · (u − W) / max(1, U − W))), r = min_lr_ratio
"""

from __future__ import annotations

import math

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
