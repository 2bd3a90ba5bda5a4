"""The rank worker of tests/test_mismatch.py's two-process gloo test (not collected: no
test_ prefix). It imports no model, so a spawned rank starts in a few seconds."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from uniweave.algorithms.grpo import percentile_keep, replay_bound_keep
from uniweave.train.distributed.comm import DistInfo
from uniweave.train.methods.grpo.mismatch import global_threshold, population_quantiles


def rank_worker(rank: int, init_file: str, data_dir: str) -> None:
    """Rank `rank` of 2: its round-robin shard of the rows (as the trainer shards them) in
    two micro-batches; the percentile threshold from `global_threshold`, each micro-batch's
    kept actions (percentile and replay bound) and the gathered diagnostics' quantiles."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        data = torch.load(Path(data_dir) / "population.pt")
        info = DistInfo(rank, 2)
        delta, mask = data["delta"][rank::2], data["mask"][rank::2]
        halves = [slice(0, 1), slice(1, None)]
        local = [delta[s][mask[s]].abs() for s in halves]
        thr = global_threshold(local, data["percentile"], info)
        keep = torch.cat(
            [
                percentile_keep(delta[s], mask[s], thr)
                & replay_bound_keep(delta[s], mask[s], data["bound"])[:, None]
                for s in halves
            ]
        )
        rows = [(delta[s].abs().sum(-1) / mask[s].sum(-1).clamp(min=1))[mask[s].any(-1)]
                for s in halves]  # fmt: skip
        quantiles = {
            **population_quantiles("abs_dlogp", local, info),
            **population_quantiles("row_abs_dlogp", rows, info),
        }
        out = {"threshold": thr, "keep": keep, "quantiles": quantiles}
        torch.save(out, Path(data_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
