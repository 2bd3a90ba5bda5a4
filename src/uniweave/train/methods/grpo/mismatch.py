"""The GRPO mismatch guard and diagnostics that need the whole global batch
(docs/numerics.md §7a): populations of per-action (or per-row) values gathered over this
rank's micro-batches and every rank, the percentile guard's threshold, and the logged
nearest-rank quantiles. Kept apart from the objective so that a process can use them
without importing a model (the two-rank test does)."""

from __future__ import annotations

import math

import torch

from uniweave.algorithms.grpo import nearest_rank
from uniweave.train.distributed.comm import DistInfo, all_gather_objects

QUANTILES = {"abs_dlogp": (50, 90, 99), "row_abs_dlogp": (50, 90)}
"""Logged quantiles of each population (`mismatch/<name>_p<q>`, plus `_max`)."""


def gather_population(parts: list[torch.Tensor], dist: DistInfo) -> torch.Tensor:
    """The float64 concatenation of `parts` (this rank's, one tensor per micro-batch) and of
    every other rank's, in rank order: one all-gather over the CPU group."""
    local = torch.cat([p.detach().double().cpu() for p in parts]) if parts else torch.zeros(0)
    return torch.cat([t.double() for t in all_gather_objects(local.double(), dist)])


def global_threshold(local: list[torch.Tensor], percentile: float, dist: DistInfo) -> float:
    """The percentile guard's threshold: `nearest_rank` of |Δ| over every scored action of
    the global batch (`local`: this rank's, one tensor per micro-batch); +inf (nothing
    masked) when the batch has no scored action."""
    values = gather_population(local, dist)
    return nearest_rank(values, percentile) if values.numel() else math.inf


def population_quantiles(name: str, parts: list[torch.Tensor], dist: DistInfo) -> dict[str, float]:
    """`mismatch/<name>_p<q>` and `mismatch/<name>_max` (nearest rank) of the population
    gathered from `parts` over ranks; 0 for an empty population."""
    values = gather_population(parts, dist)
    out = {}
    for q in (*QUANTILES[name], 100):
        key = f"mismatch/{name}_" + ("max" if q == 100 else f"p{q}")
        out[key] = nearest_rank(values, q) if values.numel() else 0.0
    return out
