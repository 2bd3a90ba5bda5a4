"""Sequence packing of a micro-batch (`trainer.packing`): several rows per batch row.

The rows of one micro-batch are placed first-fit-decreasing into batch rows as long as
its longest row, each batch row the concatenation of its sequences, and `segment_ids`
(1, 2, ... per sequence, 0 on padding) tell the model (`UnifiedModel.prepare`) to confine
attention to each sequence (block-causal mask) and to restart positions at each one; the
tiny model's conv prior stops at the boundaries too. The micro-batch keeps exactly its
rows, so the objective (a sum over scored positions normalised by the global count) is
unchanged; only the padding, which costs compute in every layer, shrinks.

A sequence's first position is never scored (it has no preceding state), so a scored
position's hidden state (at t - 1) always lies in its own sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from unirl.core.trajectory import Trajectory, TrajectoryBatch

PER_ROW = ("rollout_logp", "rollout_logp_factors", "old_logp", "old_logp_factors", "advantage")


def bins(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: indices per bin, each bin's total length <= `capacity`
    (a longer item gets a bin of its own); bins in order of their first item."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    out: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b, free in enumerate(room):
            if lengths[i] <= free:
                out[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            out.append([i])
            room.append(capacity - lengths[i])
    return out


def _concat(parts: list[Trajectory]) -> Trajectory:
    return Trajectory(
        token_ids=torch.cat([t.token_ids for t in parts]),
        modality=torch.cat([t.modality for t in parts]),
        owner=torch.cat([t.owner for t in parts]),
        visual_codes=torch.cat([t.visual_codes for t in parts]),
        image_grids=[g for t in parts for g in t.image_grids],
        sample_id="+".join(t.sample_id for t in parts),
        images=[x for t in parts for x in t.images],
    )


def pack(trajs: Sequence[Trajectory], pad_id: int) -> TrajectoryBatch:
    """`trajs` packed into batch rows as long as the longest of them (module docstring).
    ValueError for rows that carry per-row training data (GRPO/OPD rows: packing is for
    SFT rows, whose data are their positions)."""
    for t in trajs:
        for name in PER_ROW:
            if getattr(t, name) is not None:
                raise ValueError(f"packing: row {t.sample_id!r} carries {name} (SFT rows only)")
    lengths = [len(t) for t in trajs]
    groups = bins(lengths, max(lengths))
    batch = TrajectoryBatch.collate([_concat([trajs[i] for i in g]) for g in groups], pad_id)
    segments = torch.zeros_like(batch.token_ids)
    for r, group in enumerate(groups):
        start = 0
        for s, i in enumerate(group, start=1):
            segments[r, start : start + lengths[i]] = s
            start += lengths[i]
    batch.segment_ids = segments
    return batch


def padded_fraction(batch: TrajectoryBatch) -> float:
    """Share of the batch's B x T positions that are padding."""
    return 1.0 - float(batch.attention_mask.sum()) / batch.attention_mask.numel()
