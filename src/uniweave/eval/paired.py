"""Paired before/after comparisons of two evaluations of the same rows, and their verdicts.

Two evaluations in one run see the same rows with the same stateless seeds (common random
numbers, `uniweave.eval.runner`), so a change is measured per prompt: for a metric m and the
prompts i present in both, d_i = m_after(i) − m_before(i), where a prompt's value averages
its n rollouts — `mean@n`: the mean total reward; `pass@n`: 1 when any rollout passed;
`invalid_frac`: the share of its rollouts a plugin found malformed. Then

    diff = mean_i d_i,   se = std(d, ddof=1) / sqrt(n_pairs)

and the verdict, with z = `health.heldout_se` (default 2):

- "improved" when the change is in the metric's good direction and |diff| > z·se,
- "got worse" when it is in the bad direction and |diff| > z·se,
- "no detectable change" otherwise (also when fewer than 2 prompts pair up, or diff = 0).

`invalid_frac` is better lower; `mean@n` and `pass@n` are better higher.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from uniweave.eval.records import RESULTS

IMPROVED = "improved"
SAME = "no detectable change"
WORSE = "got worse"

METRICS: dict[str, bool] = {"mean@n": True, "pass@n": True, "invalid_frac": False}
"""Per-prompt metric -> whether higher is better."""

ALL = "all"
"""The pseudo-task pooling every task's prompts."""


def read_records(eval_dir: Path) -> list[dict[str, Any]]:
    """The whole records of `<eval_dir>/results.jsonl` (a torn last line is left out)."""
    path = Path(eval_dir) / RESULTS
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


def per_prompt(records: list[dict[str, Any]]) -> dict[str, dict[str, dict[tuple, float]]]:
    """task (and `ALL`) -> metric -> (task, id) -> the prompt's value (module docstring)."""
    rollouts: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        rollouts[(str(r["task"]), r["id"])].append(r)
    out: dict[str, dict[str, dict[tuple, float]]] = defaultdict(lambda: defaultdict(dict))
    for key, rs in rollouts.items():
        values = {
            "mean@n": sum(float(r["total"]) for r in rs) / len(rs),
            "pass@n": float(any(r["passed"] for r in rs)),
            "invalid_frac": sum(float(bool(r.get("invalid"))) for r in rs) / len(rs),
        }
        for task in (key[0], ALL):
            for metric, value in values.items():
                out[task][metric][key] = value
    return out


@dataclass(frozen=True)
class Paired:
    """One metric of one task, before vs after, over the prompts both evaluated."""

    task: str
    metric: str
    n: int
    before: float
    after: float
    diff: float
    se: float
    verdict: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self, z: float) -> str:
        """The one-line verdict with the test used."""
        return (
            f"{self.task} {self.metric}: {self.verdict} ({self.before:.3f} -> {self.after:.3f}, "
            f"paired diff {self.diff:+.3f} ± {self.se:.3f} SE over {self.n} prompts; "
            f"test |diff| > {z:g} SE)"
        )


def verdict(diff: float, se: float, n: int, higher_is_better: bool, z: float) -> str:
    """The verdict of a paired mean difference (module docstring)."""
    if n < 2 or diff == 0.0 or not abs(diff) > z * se:
        return SAME
    return IMPROVED if (diff > 0) == higher_is_better else WORSE


def paired(
    task: str,
    metric: str,
    before: dict[tuple, float],
    after: dict[tuple, float],
    z: float,
) -> Paired | None:
    """The paired comparison of one metric (module docstring); None when no prompt pairs."""
    keys = sorted(set(before) & set(after))
    if not keys:
        return None
    d = [after[k] - before[k] for k in keys]
    n = len(d)
    diff = sum(d) / n
    se = math.sqrt(sum((x - diff) ** 2 for x in d) / (n - 1) / n) if n > 1 else math.nan
    return Paired(
        task=task,
        metric=metric,
        n=n,
        before=sum(before[k] for k in keys) / n,
        after=sum(after[k] for k in keys) / n,
        diff=diff,
        se=se,
        verdict=verdict(diff, se, n, METRICS[metric], z),
    )


def compare(before: list[dict[str, Any]], after: list[dict[str, Any]], z: float) -> list[Paired]:
    """Every task's (and, with several tasks, `ALL`'s) metrics, before vs after."""
    a, b = per_prompt(before), per_prompt(after)
    tasks = sorted(t for t in b if t != ALL)
    if len(tasks) > 1:
        tasks.append(ALL)
    out = []
    for task in tasks:
        for metric in METRICS:
            p = paired(task, metric, a.get(task, {}).get(metric, {}), b[task][metric], z)
            if p is not None:
                out.append(p)
    return out
