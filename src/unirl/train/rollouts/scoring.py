"""The GRPO reward step: every trajectory is parsed and scored once, by the rank that
sampled it, and the scores are gathered.

Rank r holds the rows r, r + W, ... of the update (`RolloutService.shard`); it scores
them with the reward service and all ranks exchange (trajectories, scores) in one
`all_gather_object`, so every rank ends with the same trajectories and the same
`RewardResult` as one process scoring the whole batch (plugins score rows
independently and deterministically). A plugin failure on any rank is raised on every
rank, naming the first failing row in batch order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from unirl.config import UnirlConfig
from unirl.core.sample import Part, Sample
from unirl.rewards import RewardError, RewardResult, RewardService
from unirl.rewards.digit_classifier import (
    CLASSIFIER_DIR,
    load_or_fit_classifier,
    needs_digit_classifier,
)
from unirl.rollout import RolloutService, RolloutTrajectory, interleave
from unirl.train.dist.comm import DistInfo, barrier


def merge_round_robin(parts: Sequence[RewardResult]) -> RewardResult:
    """The `RewardResult` of the whole batch from the results of its round-robin shards
    (part r scored rows r, r + W, ...)."""
    world = len(parts)
    sizes = [len(p.sample_ids) for p in parts]
    offsets = [sum(sizes[:r]) for r in range(world)]
    order = torch.tensor(
        [offsets[j % world] + j // world for j in range(sum(sizes))], dtype=torch.long
    )

    def cat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat(list(tensors))[order]

    def cat_dict(name: str) -> dict[str, torch.Tensor]:
        return {k: cat([getattr(p, name)[k] for p in parts]) for k in getattr(parts[0], name)}

    dims = {p.features.shape[1] for p in parts if p.features is not None}
    if len(dims) > 1:
        raise ValueError(f"reward shards gave features of different widths {sorted(dims)}")
    features = None
    if dims:
        (d,) = dims
        blank = [torch.full((n, d), float("nan")) for n in sizes]
        features = cat([p.features if p.features is not None else b for p, b in zip(parts, blank)])
    return RewardResult(
        total=cat([p.total for p in parts]),
        raw_total=cat([p.raw_total for p in parts]),
        per_plugin=cat_dict("per_plugin"),
        applied=cat_dict("applied"),
        invalid=cat_dict("invalid"),
        errors=cat_dict("errors"),
        truncated=cat([p.truncated for p in parts]),
        overwritten=cat([p.overwritten for p in parts]),
        sample_ids=interleave([p.sample_ids for p in parts]),
        tasks=interleave([p.tasks for p in parts]),
        n_undecodable_images=sum(p.n_undecodable_images for p in parts),
        counts={
            key: {name: sum(p.counts.get(key, {}).get(name, 0.0) for p in parts) for name in names}
            for key, names in _count_names(parts).items()
        },
        features=features,
        feature_source=next((p.feature_source for p in parts if p.feature_source), ""),
    )


def _count_names(parts: Sequence[RewardResult]) -> dict[str, list[str]]:
    """Plugin label -> the count names any part reports, in first-seen order."""
    names: dict[str, list[str]] = {}
    for part in parts:
        for key, counts in part.counts.items():
            for name in counts:
                if name not in names.setdefault(key, []):
                    names[key].append(name)
    return names


def first_failure(
    failures: Sequence[tuple[str, str, list[str]] | None], samples: Sequence[Sample]
) -> tuple[str, str, list[str]] | None:
    """Of the parts' failures (message, plugin, sample ids) or None, the one naming the
    earliest row of `samples` (None when no part failed)."""
    found = [f for f in failures if f is not None]
    if not found:
        return None
    index = {s.id: i for i, s in enumerate(samples)}
    last = len(samples)
    return min(found, key=lambda f: min((index.get(i, last) for i in f[2]), default=last))


def score_sharded(
    service: RolloutService,
    rewards: RewardService,
    parse: Callable[[RolloutTrajectory], Sequence[Part] | None],
    samples: Sequence[Sample],
    local: list[RolloutTrajectory],
) -> tuple[list[RolloutTrajectory], RewardResult]:
    """All trajectories of the batch and their rewards, from this rank's `local` rows
    (the rows `service.shard` gives it) of the batch whose samples are `samples`."""
    mine = service.shard(samples)
    result, failure = None, None
    try:
        result = rewards.score(mine, local, [parse(t) for t in local])
    except RewardError as err:
        failure = (str(err), err.plugin, list(err.sample_ids))
    if service.world_size == 1:
        parts = [(local, result, failure)]
    else:
        parts = [None] * service.world_size
        torch.distributed.all_gather_object(parts, (local, result, failure), group=service.group)
    failure = first_failure([p[2] for p in parts], samples)
    if failure is not None:
        raise RewardError(*failure)
    trajs = interleave([p[0] for p in parts])
    return trajs, merge_round_robin([p[1] for p in parts])


def load_run_classifier(cfg: UnirlConfig, run_dir: Path, info: DistInfo) -> dict[str, Any]:
    """The reward resources of a run: the run's digits classifier when a reward plugin
    needs it (`needs_digit_classifier`), fitted once by rank 0 into
    `<run_dir>/classifier` and then loaded by every rank; else nothing."""
    if not needs_digit_classifier(cfg.reward):
        return {}
    if info.is_main:
        load_or_fit_classifier(run_dir / CLASSIFIER_DIR)
    barrier(info)
    return {"digit_classifier": load_or_fit_classifier(run_dir / CLASSIFIER_DIR)}
