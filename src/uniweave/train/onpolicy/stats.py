"""GRPO metrics: the means of the objective's summed loss statistics, per-task accuracy,
rollout lengths / finish reasons / throughput."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from uniweave.core.types import Owner
from uniweave.rewards import RewardResult, passes
from uniweave.rollout import RolloutTrajectory


def row_passes(result: RewardResult, threshold: float) -> torch.Tensor:
    """bool [N]: the rows that pass (`uniweave.rewards.passes`: total reward after
    truncation shaping >= `threshold`, the config's `evaluation.pass_threshold`; a row
    shaping overwrote scores 0 and fails a positive threshold)."""
    return passes(result.total, threshold)


def task_accuracy(result: RewardResult, threshold: float) -> dict[str, float]:
    """`task/<task>/accuracy`: share of the task's rows that pass (`row_passes`)."""
    n = len(result.tasks)
    ok = row_passes(result, threshold)
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


def finalize_loss_stats(sums: dict[str, float]) -> dict[str, float]:
    """Means of the GRPO objective's reduced sums (`policy/*`, `GRPOObjective.loss`).
    `policy/ratio_is_one_by_construction` is 1 only when every row's ratio denominator
    was its own forward (replay anchoring with one update per batch)."""
    n = max(sums["n_positions"], 1.0)
    rows = sums["n_rows"]
    return {
        "policy/pg_loss": sums["pg_loss"],
        "policy/kl_loss": sums["kl_loss"],
        "policy/kl_ref_mean": sums["kl_sum"] / n,
        "policy/entropy_text": sums["entropy_text_sum"] / max(sums["n_text"], 1.0),
        "policy/entropy_visual": sums["entropy_visual_sum"] / max(sums["n_visual"], 1.0),
        "policy/ratio_mean": sums["ratio_sum"] / n,
        "policy/clip_frac": sums["clipped"] / n,
        "policy/dual_clip_frac": sums["dual_clipped"] / n,
        "policy/ratio_is_one_by_construction": float(
            rows > 0 and sums["n_self_anchored_rows"] == rows
        ),
        "policy/k3_rollout_vs_replay": sums["k3_sum"] / n,
    }
