"""Training curves: the one place that chooses and draws them (`curves.png` of a run, the
report's curve table, the demo's reward curve).

`select(records)` reads `metrics.jsonl` records and makes one panel per distinct signal a
person reads, in `SIGNALS` order: loss, reward, KL to the reference, entropy (text and
image), zero-variance share, gradient norm, the teacher's JSD and top-1 agreement (OPD),
the share of rewards truncation shaping overwrote, the off-target image statistics, and
validation (the `val/*` figures, row counts left out). A panel holds the signal's metrics
the run logged at two or more updates, one line each, and leaves out:

- a constant: a metric whose logged values are all equal (GRPO's KL at a zero
  coefficient, a reward that never left 0) draws a flat line that says nothing; the
  figure's caption names it and its value instead;
- a duplicate: a metric whose (update, value) points equal those of a metric already
  drawn (the total reward and the one plugin's mean reward of a one-plugin run, the one
  task's and all tasks' validation figures); the caption names which it equals.

A panel with one metric of three or more points also draws its least-squares line and
a band of ± one residual std (`uniweave.eval.drift`, docs/numerics.md §12), the noise a
learning claim is measured against, and its title gives drift / noise. `draw` writes the
panels into a PNG (matplotlib, imported when it draws).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from uniweave.core.atomic import atomic_write
from uniweave.eval.drift import DriftNoise, drift_to_noise
from uniweave.rewards.image_stats import OFF_TARGET

VALIDATION = "val/"
COUNTS = ("/n", "/n_samples", "/n_rollouts")
"""Metric-name endings of row counts (an evaluation's size, not a result)."""

SIGNALS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("loss", ("loss",)),
    ("reward", ("reward/total_mean",)),
    ("KL to the reference", ("policy/kl_ref_mean",)),
    ("entropy", ("policy/entropy_text", "policy/entropy_visual")),
    ("zero-variance share", ("adv/frac_zero_std_groups",)),
    ("gradient norm", ("grad_norm",)),
    ("teacher JSD", ("opd/jsd",)),
    ("teacher top-1 agreement", ("opd/top1_agreement",)),
    ("rewards overwritten by truncation", ("reward/overwritten_frac",)),
    ("off-target image statistics", OFF_TARGET),
    ("validation", (VALIDATION,)),
)
"""(panel title, metric keys) per signal; the key `val/` stands for every `val/*` metric
but the row counts."""


@dataclass(frozen=True)
class Series:
    """One metric's logged (update, value) points."""

    key: str
    points: tuple[tuple[int, float], ...]

    @property
    def values(self) -> list[float]:
        return [v for _, v in self.points]


@dataclass(frozen=True)
class Panel:
    title: str
    series: tuple[Series, ...]

    @property
    def fit(self) -> DriftNoise | None:
        """The least-squares drift and residual noise of a one-metric panel of >= 3
        points (None otherwise)."""
        if len(self.series) != 1 or len(self.series[0].points) < 3:
            return None
        return drift_to_noise(self.series[0].values)


@dataclass
class Curves:
    panels: list[Panel] = field(default_factory=list)
    constant: list[tuple[str, float]] = field(default_factory=list)
    """(metric, its one value) of the metrics left out as constant."""
    duplicate: list[tuple[str, str]] = field(default_factory=list)
    """(metric, the drawn metric it equals) of the metrics left out as duplicates."""

    @property
    def series(self) -> list[Series]:
        return [s for p in self.panels for s in p.series]

    def caption(self) -> str:
        """What was left out, and why: '' when nothing was."""
        parts = []
        if self.constant:
            parts.append(
                "constant, not drawn: " + ", ".join(f"{k} = {v:.4g}" for k, v in self.constant)
            )
        if self.duplicate:
            parts.append(
                "same values as a drawn curve, not drawn: "
                + ", ".join(f"{k} (= {o})" for k, o in self.duplicate)
            )
        return "; ".join(parts)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _keys(pattern: str, records: list[dict[str, Any]]) -> list[str]:
    if pattern != VALIDATION:
        return [pattern]
    found = {k for r in records for k in r if k.startswith(VALIDATION)}
    return sorted(k for k in found if not k.endswith(COUNTS))


def select(records: list[dict[str, Any]], signals=SIGNALS) -> Curves:
    """The panels of `records` (metrics.jsonl lines) for `signals` (module docstring)."""
    out = Curves()
    drawn: dict[tuple[tuple[int, float], ...], str] = {}
    for title, patterns in signals:
        series = []
        for key in (k for p in patterns for k in _keys(p, records)):
            points = tuple(
                (int(r["update"]), float(r[key]))
                for r in records
                if "update" in r and _number(r.get(key))
            )
            if len(points) < 2:
                continue
            if len({v for _, v in points}) == 1:
                out.constant.append((key, points[0][1]))
            elif points in drawn:
                out.duplicate.append((key, drawn[points]))
            else:
                drawn[points] = key
                series.append(Series(key, points))
        if series:
            out.panels.append(Panel(title, tuple(series)))
    return out


def draw(curves: Curves, out_png: Path, title: str | None = None) -> Path | None:
    """Write `curves`' panels into `out_png` (atomically), three to a row, the caption
    (what was left out) under them; a figure of the caption alone when every metric was
    left out; None (nothing written) when there was no metric at all."""
    caption = curves.caption()
    if not curves.panels and not caption:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    if not curves.panels:
        fig = plt.figure(figsize=(6.0, 1.0))
        fig.text(0.02, 0.5, caption, fontsize=8, wrap=True, va="center")
        with atomic_write(out_png, "wb") as f:
            fig.savefig(f, format="png", dpi=100)
        plt.close(fig)
        return out_png
    n = len(curves.panels)
    cols = min(3, n)
    rows = math.ceil(n / cols)
    foot = 0.55 + (0.3 * math.ceil(len(caption) / (48 * cols)) if caption else 0.0)
    head = 0.45 + (0.3 if title else 0.0)
    width, height = 4.6 * cols, 3.0 * rows + foot + head - 0.35
    fig, axes = plt.subplots(rows, cols, figsize=(width, height), squeeze=False)
    # fixed margins in inches (tight_layout would draw every tick label once more)
    fig.subplots_adjust(
        left=0.75 / width,
        right=1 - 0.2 / width,
        bottom=(foot + 0.1) / height,
        top=1 - head / height,
        wspace=0.9 * cols / (width - 0.95),
        hspace=0.85 * rows / (3.0 * rows - 0.85),
    )
    for ax, panel in zip(axes.flat, curves.panels):
        for s in panel.series:
            x = [u for u, _ in s.points]
            ax.plot(x, s.values, lw=1.2, label=s.key)
        fit = panel.fit
        if fit is not None:
            fx = np.array([u for u, _ in panel.series[0].points], dtype=float)
            y = np.array(panel.series[0].values)
            line = y.mean() + fit.slope * (np.arange(y.size) - (y.size - 1) / 2)
            ax.plot(fx, line, color="tab:red", lw=1.0)
            ax.fill_between(fx, line - fit.noise, line + fit.noise, color="tab:red", alpha=0.15)
            ax.set_title(
                f"{panel.title}: drift {fit.drift:+.3g}, noise {fit.noise:.3g}", fontsize=9
            )
        else:
            ax.set_title(panel.title, fontsize=9)
        ax.set_xlabel("update", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=10)
    if caption:
        fig.text(0.01, 0.1 / height, caption, fontsize=8, wrap=True, va="bottom")
    with atomic_write(out_png, "wb") as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)
    return out_png
