"""Where SFT batches come from: the serialised training rows of a split, and the
dataset cursor (`DatasetSource`) that walks them update by update."""

from __future__ import annotations

import logging
import zlib
from dataclasses import replace

import numpy as np

from uniweave.config import ConfigError, UniweaveConfig
from uniweave.config.resolved import data_tasks
from uniweave.config.schema import Split
from uniweave.core.seeding import seed_for
from uniweave.core.trajectory import Trajectory
from uniweave.data.digits import make_task_samples
from uniweave.data.memo import memoized_encodings
from uniweave.models.base import UnifiedModel
from uniweave.models.build import dataset_rows
from uniweave.train.engine.protocols import BatchSource

logger = logging.getLogger(__name__)


def task_sizes(cfg: UniweaveConfig, n_per_task: int) -> dict[str, int]:
    """Rows per task: `n_per_task` each, or, with `data.task_weights`, n · w_t / mean(w)
    (the mixture keeps its total size; a task's rows cycle through the split's images with
    fresh random options)."""
    weights = cfg.data.task_weights or {}
    if not weights:
        return {task: n_per_task for task in data_tasks(cfg.data)}
    w = {task: weights.get(task, 1.0) for task in data_tasks(cfg.data)}
    mean = sum(w.values()) / len(w)
    return {task: max(1, round(n_per_task * w[task] / mean)) for task in data_tasks(cfg.data)}


def sft_trajectories(cfg: UniweaveConfig, model: UnifiedModel, split: Split, n_per_task: int):
    """Serialised SFT rows of `split`: the `data.path` rows of that split and of the
    `data.tasks` (`dataset_rows`: images through the model's processor), or
    `n_per_task` rows of each built-in digits task.

    `data.max_sequence_tokens`: a row of more positions is a ConfigError naming its
    `file:line` (digits: its task and id) and the key, or (`data.over_length: drop`) left
    out, the count logged."""
    where: dict[str, str] = {}
    if cfg.data.path:
        rows = dataset_rows(cfg, model, split)
        samples, where = rows.samples, rows.where
    else:
        samples = [
            s
            for task, n in task_sizes(cfg, n_per_task).items()
            for s in make_task_samples(task, split, n, seed=cfg.data.seed)
        ]
    with memoized_encodings():  # repeated texts and images are encoded once
        trajs = [model.prompt_trajectory(s, add_generation_prompt=False) for s in samples]
    return within_limit(cfg, trajs, samples, where, split)


def within_limit(cfg: UniweaveConfig, trajs: list, samples: list, where: dict, split: str) -> list:
    """`trajs` (serialised `samples`) under `data.max_sequence_tokens` (`sft_trajectories`)."""
    limit = cfg.data.max_sequence_tokens
    if limit is None:
        return trajs
    kept = []
    for traj, sample in zip(trajs, samples):
        if len(traj) <= limit:
            kept.append(traj)
        elif cfg.data.over_length == "refuse":
            row = where.get(sample.id) or f"task {sample.task!r} row {sample.id!r}"
            raise ConfigError(
                f"{row}: the {split} row serialises to {len(traj)} positions, more than "
                f"{limit} (set data.over_length=drop to leave such rows out)",
                key="data.max_sequence_tokens",
            )
    dropped = len(trajs) - len(kept)
    if dropped:
        logger.warning(
            "data.max_sequence_tokens=%d: dropped %d of %d %s rows (data.over_length: drop)",
            limit,
            dropped,
            len(trajs),
            split,
        )
    if trajs and not kept:
        raise ConfigError(
            f"every {split} row is longer than {limit} positions",
            key="data.max_sequence_tokens",
        )
    return kept


def _row_seed_index(sample_id: str) -> int:
    return zlib.crc32(sample_id.encode())


class DatasetSource(BatchSource):
    """Global batches of `batch_size` rows walked through per-epoch permutations."""

    def __init__(
        self,
        trajectories: list[Trajectory],
        batch_size: int,
        seed: int,
        shuffle: bool = True,
        run_seed: int = 0,
    ) -> None:
        if not trajectories:
            raise ValueError("the SFT dataset is empty")
        self.rows = trajectories
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.run_seed = run_seed
        self._orders: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            n = len(self.rows)
            rng = np.random.default_rng([self.seed, epoch])
            self._orders = {epoch: rng.permutation(n) if self.shuffle else np.arange(n)}
        return self._orders[epoch]

    def indices(self, update: int) -> list[int]:
        n = len(self.rows)
        out = []
        for k in range(update * self.batch_size, (update + 1) * self.batch_size):
            epoch, offset = divmod(k, n)
            out.append(int(self._order(epoch)[offset]))
        return out

    def global_batch(self, update: int) -> list[Trajectory]:
        """The update's rows, each with its noise seed (module docstring)."""
        out = []
        for i in self.indices(update):
            row = self.rows[i]
            seed = seed_for(self.run_seed, update, _row_seed_index(row.sample_id), 0)
            out.append(replace(row, seed=seed))
        return out

    def batch_metrics(self, update: int) -> dict[str, float]:
        return {"epoch": update * self.batch_size / len(self.rows)}

    def epochs_done(self, update: int) -> int:
        """Epochs completed by updates 0..update-1: the cursor is at row update·B, so
        epoch e ends with update ceil(e·R / B) (R rows, B rows per update)."""
        return update * self.batch_size // len(self.rows)
