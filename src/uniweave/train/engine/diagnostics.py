"""Gradient diagnostics (`logging.gradient_diagnostics_every_updates`): the pre-clip
gradients of an objective's two additive loss parts (`Objective.gradient_parts`), each
part's L2 norm, their ratio and cosine (docs/numerics.md §9).

With the setting on, every update micro-batches the two parts apart — the first part's
rows, then the second's (`part_micro_batches`); the loss is additive over any split, so a
micro-batch's one backward adds to one part only. On an update that logs, the trainer
takes the accumulated `.grad` at the first micro-batch of the second part (`take_grads`),
and after the last micro-batch `merge_parts` measures both parts and leaves their sum in
`.grad`, exactly the gradient of the whole objective.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from uniweave.config.trainer import TrainerConfig
from uniweave.core.trajectory import Trajectory
from uniweave.train.distributed.comm import DistInfo
from uniweave.train.engine.batching import rank_micro_batches
from uniweave.train.engine.protocols import Objective

Grads = list[torch.Tensor | None]
"""The trainable parameters' gradients in order (None: no gradient, i.e. zero)."""


def part_micro_batches(
    trajs: list[Trajectory],
    objective: Objective,
    every: int,
    update: int,
    dist: DistInfo,
    t: TrainerConfig,
) -> tuple[list[list[Trajectory]], int | None]:
    """This rank's micro-batches of update `update` (0-based) and, on an update that logs
    gradient diagnostics (every `every`-th), the index of the first micro-batch of the
    objective's second gradient part. With `every` > 0 and an objective that has two
    parts, every update micro-batches the parts apart (first part's rows, then the
    second's)."""
    parts = objective.gradient_parts
    if every == 0 or parts is None:
        return rank_micro_batches(trajs, dist, t), None
    second = [objective.in_second_part(traj) for traj in trajs]
    head = rank_micro_batches([x for x, s in zip(trajs, second) if not s], dist, t)
    tail = rank_micro_batches([x for x, s in zip(trajs, second) if s], dist, t)
    return head + tail, len(head) if (update + 1) % every == 0 else None


def take_grads(params: Sequence[nn.Parameter]) -> Grads:
    """The trainable parameters' `.grad` (the gradient accumulated so far), which are
    then cleared so that the next backward starts a new accumulation."""
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    return grads


def merge_parts(
    params: Sequence[nn.Parameter], first: Grads | None, names: tuple[str, str]
) -> dict[str, float]:
    """After the last micro-batch: the first part's gradient `first` (taken at the second
    part's first micro-batch; None when the second part began at micro-batch 0, so the
    first part is what `.grad` holds now) and the second's (`.grad` now) measured by
    `gradient_diagnostics`; their sum is left in `.grad`."""
    first = take_grads(params) if first is None else first
    second = take_grads(params)
    diagnostics = gradient_diagnostics(first, second, names)
    for p, a, b in zip(params, first, second):
        p.grad = a if b is None else b if a is None else a + b
    return diagnostics


def gradient_diagnostics(first: Grads, second: Grads, names: tuple[str, str]) -> dict[str, float]:
    """Pre-clip L2 norms of two gradients (per-parameter lists, None = zero), the ratio
    of the first's to the second's and their cosine, in float64 (docs/numerics.md §9).
    Ratio and cosine are left out when either norm is 0 (an update without rows of a
    part)."""
    zero = torch.zeros((), dtype=torch.float64)
    sq_a, sq_b, dot = zero, zero, zero
    for a, b in zip(first, second):
        a64 = None if a is None else a.detach().double()
        b64 = None if b is None else b.detach().double()
        if a64 is not None:
            sq_a = sq_a + a64.pow(2).sum().cpu()
        if b64 is not None:
            sq_b = sq_b + b64.pow(2).sum().cpu()
        if a64 is not None and b64 is not None:
            dot = dot + (a64 * b64).sum().cpu()
    sq_a, sq_b, dot = torch.stack([sq_a, sq_b, dot]).tolist()
    na, nb = math.sqrt(sq_a), math.sqrt(sq_b)
    x, y = names
    out = {f"grad/{x}_norm": na, f"grad/{y}_norm": nb}
    if na > 0 and nb > 0:
        out[f"grad/{x}_to_{y}_norm_ratio"] = na / nb
        out[f"grad/{x}_{y}_cosine"] = dot / (na * nb)
    return out
