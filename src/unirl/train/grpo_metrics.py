"""GRPO metrics: per-update loss statistics summed by the objective and reduced over
ranks (`StepStats`), per-task accuracy, rollout lengths / finish reasons / throughput."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from unirl.config.algorithms import GRPOConfig
from unirl.core.types import Owner
from unirl.rewards import RewardResult
from unirl.rollout import RolloutTrajectory
from unirl.train.distributed import DistInfo, all_reduce_sum


class StepStats:
    """Per-update metric sums written by the objective, reduced over ranks on read."""

    def __init__(self, keys: Sequence[str]) -> None:
        self.keys = sorted(keys)
        self._sums: dict[int, dict[str, float]] = {}

    def add(self, update: int, values: dict[str, float]) -> None:
        sums = self._sums.setdefault(update, dict.fromkeys(self.keys, 0.0))
        for key, value in values.items():
            sums[key] += float(value)

    def reduce(self, update: int, info: DistInfo) -> dict[str, float]:
        """The sums of `update` over every rank (a collective: call on all ranks)."""
        sums = self._sums.pop(update, dict.fromkeys(self.keys, 0.0))
        flat = torch.tensor([sums[k] for k in self.keys], dtype=torch.float64)
        flat = all_reduce_sum(flat, info)
        return dict(zip(self.keys, flat.tolist()))


def task_accuracy(result: RewardResult) -> dict[str, float]:
    """`task/<task>/accuracy`: share of the task's rows that every plugin scoring them
    passes (score >= 0.5: a verifier's 1, or p(target) >= 0.5 for the classifier) and
    that truncation shaping did not overwrite."""
    n = len(result.tasks)
    ok = ~result.overwritten.clone()
    for key, scores in result.per_plugin.items():
        ok &= ~result.applied[key] | (scores >= 0.5)
    out = {}
    for task in sorted({t for t in result.tasks if t is not None}):
        rows = torch.tensor([result.tasks[i] == task for i in range(n)])
        out[f"task/{task}/accuracy"] = float(ok[rows].double().mean())
    return out


def rollout_stats(trajs: Sequence[RolloutTrajectory], seconds: float) -> dict[str, float]:
    """Response lengths (sampled positions per row), finish-reason shares and rollout
    throughput (sampled positions per second)."""
    lengths = torch.tensor(
        [int((t.owner == Owner.POLICY).sum()) for t in trajs], dtype=torch.float64
    )
    reasons = Counter(t.finish_reason for t in trajs)
    out = {
        "rollout/response_len_mean": float(lengths.mean()),
        "rollout/response_len_max": float(lengths.max()),
        "rollout/n_rows": float(len(trajs)),
        "rollout/tokens_per_s": float(lengths.sum()) / max(seconds, 1e-9),
    }
    for reason in ("eos", "cap", "context", "cycle", "length_exact", "invalid"):
        out[f"rollout/finish_{reason}_frac"] = reasons.get(reason, 0) / len(trajs)
    return out


LOSS_STAT_KEYS = (
    "n_positions",
    "n_text",
    "n_visual",
    "pg_loss",
    "kl_loss",
    "kl_sum",
    "entropy_text_sum",
    "entropy_visual_sum",
    "ratio_sum",
    "clipped",
    "dual_clipped",
    "k3_sum",
)


def finalize_loss_stats(
    sums: dict[str, float], algo: GRPOConfig, first_of_round: bool = True
) -> dict[str, float]:
    """Means of the objective's reduced sums (`policy/*`). Under old_logp_source replay,
    on the first update of a rollout batch (every update when updates_per_batch = 1),
    the ratio is 1 and the clip fraction 0 by construction:
    `policy/ratio_is_one_by_construction` says so."""
    n = max(sums["n_positions"], 1.0)
    by_construction = algo.old_logp_source == "replay" and first_of_round
    return {
        "policy/pg_loss": sums["pg_loss"],
        "policy/kl_loss": sums["kl_loss"],
        "policy/kl_ref_mean": sums["kl_sum"] / n,
        "policy/entropy_text": sums["entropy_text_sum"] / max(sums["n_text"], 1.0),
        "policy/entropy_visual": sums["entropy_visual_sum"] / max(sums["n_visual"], 1.0),
        "policy/ratio_mean": sums["ratio_sum"] / n,
        "policy/clip_frac": sums["clipped"] / n,
        "policy/dual_clip_frac": sums["dual_clipped"] / n,
        "policy/ratio_is_one_by_construction": float(by_construction),
        "policy/k3_rollout_vs_replay": sums["k3_sum"] / n,
    }
