"""Run metrics: one JSONL line per update (flushed), TensorBoard scalars, a progress bar,
and a PNG plot of the curves at the end of a run.

On resume the JSONL file is rewritten to keep only updates at or before the checkpoint,
so a resumed run has no duplicate and no missing update.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

METRICS = "metrics.jsonl"
MAX_PLOTS = 12


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All complete JSONL records of a metrics file (a torn last line is dropped)."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


def truncate_metrics(path: Path, last_update: int) -> None:
    """Keep only records with update <= last_update; atomic rewrite."""
    kept = [r for r in read_metrics(path) if r.get("update", -1) <= last_update]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
    os.replace(tmp, path)


class MetricsLogger:
    """JSONL (+ optional TensorBoard) sink for per-update scalar metrics. Rank 0 only."""

    def __init__(self, run_dir: Path, tensorboard: bool) -> None:
        self.path = Path(run_dir) / METRICS
        self._file = open(self.path, "a")  # noqa: SIM115 - closed in close()
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))

    def log(self, update: int, metrics: dict[str, Any]) -> None:
        record = {"update": update, **metrics}
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(key, value, update)
            self._tb.flush()

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


class Progress:
    """A rich progress bar with updates/s, loss and ETA; silent under CI=true or no TTY."""

    def __init__(self, total: int, start: int, enabled: bool) -> None:
        self._progress = None
        if enabled and sys.stderr.isatty() and os.environ.get("CI", "").lower() != "true":
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeRemainingColumn,
            )
            from rich.progress import (
                Progress as RichProgress,
            )

            self._progress = RichProgress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[rate]:.2f} upd/s  loss {task.fields[loss]:.4f}"),
                TimeRemainingColumn(),
                transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task(
                "train", total=total, completed=start, rate=0.0, loss=float("nan")
            )

    def advance(self, loss: float, rate: float) -> None:
        if self._progress is not None:
            self._progress.update(self._task, advance=1, loss=loss, rate=rate)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()


def plot_metrics(metrics_path: Path, out_png: Path, keys: list[str] | None = None) -> Path | None:
    """Plot `keys` (default: loss, reward/* and val/* first, at most MAX_PLOTS metrics)
    against the update number into `out_png`."""
    records = read_metrics(metrics_path)
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    numeric = sorted(
        k for k in records[-1] if k != "update" and isinstance(records[-1][k], (int, float))
    )
    if keys is None:
        # the headline curves first; a GRPO run logs ~70 metrics, too many to draw quickly
        first = [k for k in numeric if k == "loss" or k.startswith(("reward/", "val/"))]
        keys = (first + [k for k in numeric if k not in first])[:MAX_PLOTS]
    keys = [k for k in keys if k in numeric]
    if not keys:
        return None
    cols = min(3, len(keys))
    rows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        points = [(r["update"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
        ax.plot([p[0] for p in points], [p[1] for p in points], lw=1.2)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("update", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    fig.tight_layout()
    tmp = out_png.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, out_png)
    return out_png
