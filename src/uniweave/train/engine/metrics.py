"""Run metrics: JSONL lines (flushed), TensorBoard scalars, Weights & Biases, rollout
samples and a progress bar (the curves are drawn by the run report: `uniweave.eval.curves`).

On resume the JSONL file and the TensorBoard events files are rewritten to keep only
updates at or before the checkpoint, so a resumed run has no duplicate and no missing update (W&B keeps its step monotonic:
the re-run updates after the checkpoint, bitwise equal on an exact resume, are dropped by
it).
"""

from __future__ import annotations

import json
import math
import os
import secrets
import struct
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from uniweave.config.schema import LoggingConfig
from uniweave.core.atomic import atomic_write, write_text_atomic
from uniweave.core.status import log_only, status

METRICS = "metrics.jsonl"
TENSORBOARD = "tensorboard"
WANDB_ID = "wandb_run_id"
WANDB_PROJECT = "uniweave"
SAMPLE_KEYS = ("prompt", "response", "reward", "image")


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
    """Keep only records with update <= last_update; atomic rewrite (no file: nothing)."""
    if not path.is_file():
        return
    kept = [r for r in read_metrics(path) if r.get("update", -1) <= last_update]
    write_text_atomic(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))


def _tf_records(data: bytes) -> list[bytes]:
    """The whole records of a TFRecord byte string (a TensorBoard events file): each is
    length (uint64 LE) + its masked CRC (4) + payload + the payload's masked CRC (4). A
    torn last record is dropped."""
    out, pos = [], 0
    while pos + 12 <= len(data):
        (length,) = struct.unpack("<Q", data[pos : pos + 8])
        end = pos + 12 + length + 4
        if end > len(data):
            break
        out.append(data[pos:end])
        pos = end
    return out


def truncate_tensorboard(run_dir: Path, last_update: int) -> None:
    """Rewrite every events file under ``<run_dir>/tensorboard`` keeping only the events
    with step <= last_update (the file-version header has step 0), record bytes unchanged,
    each file atomically — what `truncate_metrics` does for the JSONL file."""
    root = Path(run_dir) / TENSORBOARD
    if not root.is_dir():
        return
    from tensorboard.compat.proto.event_pb2 import Event

    for path in sorted(root.rglob("events.out.tfevents.*")):
        records = _tf_records(path.read_bytes())
        kept = [r for r in records if Event.FromString(r[12:-4]).step <= last_update]
        if len(kept) != len(records) or sum(map(len, records)) != path.stat().st_size:
            with atomic_write(path, "wb") as f:
                f.write(b"".join(kept))


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    return {
        k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)
    }


def sample_image(image: Any) -> np.ndarray | None:
    """A sample's image as uint8 [H, W] or [H, W, 3] (round(255 x)); ValueError unless it
    is None or a float array of that shape with values in [0, 1]."""
    if image is None:
        return None
    arr = np.asarray(image)
    if arr.dtype.kind != "f" or not (arr.ndim == 2 or (arr.ndim == 3 and arr.shape[2] == 3)):
        raise ValueError(
            f"sample image: expected a float array [H, W] or [H, W, 3], got {arr.dtype} "
            f"{list(arr.shape)}"
        )
    if not np.all((arr >= 0.0) & (arr <= 1.0)):
        raise ValueError("sample image: values must lie in [0, 1]")
    return np.round(arr * 255.0).astype(np.uint8)


def _sample_text(sample: dict[str, Any]) -> str:
    reward = sample["reward"]
    shown = "none" if reward is None else f"{reward:.4f}"
    return (
        f"**prompt**\n\n    {sample['prompt']}\n\n**response**\n\n    {sample['response']}"
        f"\n\n**reward** {shown}"
    )


class MetricsLogger:
    """Rank-0 sink of per-update scalar metrics and of rollout samples (`logging:`).

    Sinks: `<run_dir>/metrics.jsonl` (`jsonl`), `<run_dir>/tensorboard/` (`tensorboard`),
    and Weights & Biases (`wandb`: a run in `<run_dir>/wandb`, named `run.name`, with the
    resolved `config`; its id is kept in `<run_dir>/wandb_run_id` so a resumed run goes on
    in the same W&B run).

    Cadence: `log(update, metrics, force)` writes update u when u % `every` == 0 or when
    `force` is set; the trainer forces the run's last update and every update that ran an
    evaluation, so the final state and every `val/*` figure are always recorded. A written
    record holds that update's values (no window averages). `log_samples` writes when
    `samples_due(update)`: `samples_every` > 0 and update % `samples_every` == 0.
    """

    def __init__(
        self, run_dir: Path, logging: LoggingConfig, config: dict[str, Any] | None = None
    ) -> None:
        self.run_dir = Path(run_dir)
        self.cfg = logging
        self.path = self.run_dir / METRICS
        self._file = open(self.path, "a") if logging.jsonl else None  # noqa: SIM115
        self._tb = None
        if logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / TENSORBOARD))
        self._wandb = self._start_wandb(config) if logging.wandb else None

    def _start_wandb(self, config: dict[str, Any] | None) -> Any:
        import wandb

        id_file = self.run_dir / WANDB_ID
        if id_file.is_file():
            run_id = id_file.read_text().strip()
        else:
            run_id = secrets.token_hex(6)
            id_file.write_text(run_id + "\n")
        name = (config or {}).get("run", {}).get("name")
        return wandb.init(
            project=os.environ.get("WANDB_PROJECT", WANDB_PROJECT),
            name=name,
            id=run_id,
            resume="allow",
            dir=str(self.run_dir),
            config=config,
        )

    def due(self, update: int) -> bool:
        """Whether `log` writes update `update` unforced."""
        return update % self.cfg.every == 0

    def samples_due(self, update: int) -> bool:
        """Whether `log_samples` writes at update `update`."""
        return self.cfg.samples_every > 0 and update % self.cfg.samples_every == 0

    def log(self, update: int, metrics: dict[str, Any], force: bool = False) -> bool:
        """Write update `update`'s metrics to every sink if due (or forced); return
        whether it was written."""
        if not (force or self.due(update)):
            return False
        if self._file is not None:
            self._file.write(json.dumps({"update": update, **metrics}, sort_keys=True) + "\n")
            self._file.flush()
            os.fsync(self._file.fileno())
        scalars = _scalars(metrics)
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, update)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=update)
        return True

    def log_samples(self, update: int, samples: list[dict[str, Any]]) -> bool:
        """Write rollout samples (dicts with keys `SAMPLE_KEYS`: prompt, response: str;
        reward: float | None; image: float array [H, W] / [H, W, 3] in [0, 1] | None) if
        `samples_due(update)`: TensorBoard text `samples/<i>` and image `samples/<i>`,
        W&B a table `samples` (update, prompt, response, reward, image). Returns whether
        they were written."""
        if not self.samples_due(update) or not samples:
            return False
        for i, sample in enumerate(samples):
            missing = [k for k in SAMPLE_KEYS if k not in sample]
            if missing:
                raise ValueError(f"sample {i}: missing keys {missing}")
        images = [sample_image(s["image"]) for s in samples]
        if self._tb is not None:
            for i, (sample, image) in enumerate(zip(samples, images)):
                self._tb.add_text(f"samples/{i}", _sample_text(sample), update)
                if image is not None:
                    fmt = "HW" if image.ndim == 2 else "HWC"
                    self._tb.add_image(f"samples/{i}", image, update, dataformats=fmt)
            self._tb.flush()
        if self._wandb is not None:
            import wandb

            table = wandb.Table(columns=["update", *SAMPLE_KEYS])
            for sample, image in zip(samples, images):
                picture = None if image is None else wandb.Image(image)
                table.add_data(
                    update, sample["prompt"], sample["response"], sample["reward"], picture
                )
            self._wandb.log({"samples": table}, step=update)
        return True

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


ProgressFields = tuple[tuple[str, str, str], ...]
"""(label, metric key, format spec) of what a progress line shows beside the loss: the
method's own figures (`uniweave.config.methods.MethodSpec.progress`)."""


def interactive() -> bool:
    """Whether progress is drawn for a person: stderr is a terminal and CI is not `true`.
    Otherwise (a log file, `nohup`, SLURM, CI) training prints plain lines instead."""
    return sys.stderr.isatty() and os.environ.get("CI", "").lower() != "true"


def _duration(seconds: float) -> str:
    seconds = int(round(max(seconds, 0.0)))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


def progress_line(
    update: int,
    total: int,
    metrics: dict[str, Any],
    seconds_per_update: float,
    fields: ProgressFields = (),
) -> str:
    """One plain log line: update/total, loss, the method's `fields` the update logged
    (GRPO: reward, KL, zero-variance share), lr, s/update and the ETA at that pace."""
    parts = [f"update {update}/{total}", f"loss {metrics['loss']:.4f}"]
    for label, key, fmt in fields:
        if isinstance(metrics.get(key), (int, float)):
            parts.append(f"{label} {metrics[key]:{fmt}}")
    if isinstance(metrics.get("lr"), (int, float)):
        parts.append(f"lr {metrics['lr']:.3g}")
    parts.append(f"{seconds_per_update:.2f} s/update")
    parts.append(f"ETA {_duration(seconds_per_update * (total - update))}")
    return "  ".join(parts)


class Progress:
    """Progress of a run for a person. On an interactive terminal (`interactive`) a rich
    bar with updates/s, loss and ETA (when `enabled`, i.e. `logging.progress_bar`);
    elsewhere (`plain`: a log file, `nohup`, SLURM, CI=true) one `progress_line` on stdout
    per logged update (`logged`), whatever `enabled` says. `fields`: the method's figures
    on the line (`progress_line`)."""

    def __init__(
        self,
        total: int,
        start: int,
        enabled: bool,
        plain: bool = False,
        fields: ProgressFields = (),
    ) -> None:
        self._progress = None
        self.total = total
        self.plain = plain
        self.fields = fields
        self._start, self._t0 = start, time.monotonic()
        if enabled and not plain:
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

    def logged(self, update: int, metrics: dict[str, Any]) -> None:
        """Update `update` was logged: its line (s/update: the mean wall time per update
        since this process started training, evaluations and checkpoints included) in the
        run log, and printed in plain mode (`uniweave.core.status`)."""
        pace = (time.monotonic() - self._t0) / max(update - self._start, 1)
        line = progress_line(update, self.total, metrics, pace, self.fields)
        if self.plain:
            status(line)
        else:  # the terminal shows the bar; the run log gets the line
            log_only(line)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
