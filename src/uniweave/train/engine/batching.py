"""How a global batch becomes this rank's micro-batches, and sequence packing of a
micro-batch.

Micro-batching (`rank_micro_batches`): this rank takes its round-robin shard of the
global batch and splits it into micro-batches of `trainer.micro_batch_size` rows or, with
`trainer.micro_token_budget`, into length-sorted buckets whose padded size (rows x longest
row) stays within the budget and whose row count stays within `micro_batch_size`.

Sequence packing of a micro-batch (`trainer.packing`): several rows per batch row.

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

from uniweave.config import ConfigError
from uniweave.config.trainer import TrainerConfig
from uniweave.core.trajectory import Trajectory, TrajectoryBatch
from uniweave.train.distributed.comm import DistInfo

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


def micro_batches(trajs: list[Trajectory], size: int, token_budget: int) -> list[list[int]]:
    """Indices of `trajs` per micro-batch: fixed `size` rows, or, with a token budget,
    length-sorted buckets whose padded size (rows × longest row) stays within the budget
    and that hold at most `size` rows (a row longer than the budget gets a bucket of its
    own)."""
    if token_budget <= 0:
        return [list(range(i, min(i + size, len(trajs)))) for i in range(0, len(trajs), size)]
    order = sorted(range(len(trajs)), key=lambda i: len(trajs[i]))
    buckets: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = max([len(trajs[j]) for j in current] + [len(trajs[i])])
        if current and (len(current) >= size or longest * (len(current) + 1) > token_budget):
            buckets.append(current)
            current = []
        current.append(i)
    if current:
        buckets.append(current)
    return buckets


def rank_micro_batches(
    trajs: list[Trajectory], dist_info: DistInfo, cfg: TrainerConfig
) -> list[list[Trajectory]]:
    """Training geometry: this rank's round-robin shard of a global batch, split into
    micro-batches (`micro_batch_size`, or length buckets under `micro_token_budget`).
    Every pass that must see the batch as training does (the update itself, an anchor
    replay before it) uses this."""
    shard = trajs[dist_info.rank :: dist_info.world_size]
    groups = micro_batches(shard, cfg.micro_batch_size, cfg.micro_token_budget or 0)
    return [[shard[i] for i in g] for g in groups]


def check_rank_geometry(cfg: TrainerConfig, world_size: int) -> None:
    """ConfigError on `trainer.global_batch_size` when, under fsdp2, the round-robin shards
    of a global batch over `world_size` ranks would give ranks different numbers of
    micro-batches (or a rank no rows): every forward all-gathers on every rank, so the
    collectives would not line up. Checked when the world size is known (torchrun's, or a
    resume at another world size than the checkpoint's)."""
    if cfg.parallel != "fsdp2" or world_size <= 1:
        return
    rows = [len(range(r, cfg.global_batch_size, world_size)) for r in range(world_size)]
    counts = {-(-n // cfg.micro_batch_size) for n in rows}
    if min(rows) == 0 or len(counts) > 1:
        raise ConfigError(
            f"{cfg.global_batch_size} rows over {world_size} fsdp2 ranks give them "
            f"{min(rows)}..{max(rows)} rows, {min(counts)}..{max(counts)} micro-batches of "
            f"{cfg.micro_batch_size}: every rank needs the same number of forwards (use a "
            "global_batch_size whose per-rank share splits into equally many micro-batches, "
            "e.g. a multiple of world size x micro_batch_size)",
            key="trainer.global_batch_size",
        )
