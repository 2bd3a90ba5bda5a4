"""What a run keeps besides its newest checkpoints: the best checkpoint
(`checkpoint.keep_best`) and the rollout archive (`checkpoint.save_rollouts`). The files
and their formats are `uniweave.train.state.artifacts`'; pruning (`checkpoint.keep_last`,
which spares the best checkpoint) is `uniweave.train.state.checkpoint.prune`, run when a
checkpoint is committed.

`Retention` holds the run's side of both: the best record, decided on rank 0 at each
evaluated update and learnt by every rank (an improvement forces a checkpoint), and the
inventory of the rollout files written so far. Both go into every checkpoint's state
(`state`), and a resume restores them from it (`resume`, then on rank 0 `resume_files`,
which rewrites ``best.json``, deletes the rollout files of later updates and refuses to
go on when those the checkpoint links changed).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from uniweave.config import UniweaveConfig
from uniweave.train.distributed.comm import DistInfo, all_reduce_sum
from uniweave.train.engine.errors import TrainingError
from uniweave.train.engine.protocols import BatchSource
from uniweave.train.state import artifacts
from uniweave.train.state import checkpoint as ckpt


class Retention:
    def __init__(self, cfg: UniweaveConfig, run_dir: Path, dist: DistInfo) -> None:
        self.c = cfg.checkpoint
        self.run_dir = run_dir
        self.dist = dist
        self.best: dict[str, Any] | None = None  # checkpoint.keep_best (rank 0)
        self.rollout_files: dict[str, tuple[int, str]] = {}  # checkpoint.save_rollouts

    def state(self) -> dict[str, Any]:
        """This retention's part of a checkpoint's state: the best record (when there is
        one) and the rollout files' names and inventory hash (with `save_rollouts`)."""
        out: dict[str, Any] = {}
        if self.best is not None:
            out["best"] = self.best
        if self.c.save_rollouts:
            out["rollouts"] = {
                "files": sorted(self.rollout_files),
                "inventory_sha256": artifacts.inventory_sha256(self.rollout_files),
            }
        return out

    def track_best(
        self, update: int, metrics: dict[str, float], evaluated: bool, has_evaluator: bool
    ) -> bool:
        """`checkpoint.keep_best`: whether evaluated update `update` improves the best value
        (rank 0 decides, every rank learns it); the new record goes into `self.best`."""
        c = self.c
        if c.keep_best is None or not evaluated:
            return False
        improved = False
        if has_evaluator and self.dist.is_main:
            if c.keep_best not in metrics:
                found = ", ".join(sorted(k for k in metrics if k.startswith("val/")))
                raise TrainingError(
                    f"checkpoint.keep_best: {c.keep_best} is not among the validation "
                    f"metrics of update {update} ({found})"
                )
            value = float(metrics[c.keep_best])
            if math.isfinite(value) and artifacts.better(value, self.best, c.keep_best_mode):
                name = ckpt.checkpoint_dir(self.run_dir) / f"{ckpt.PREFIX}{update:06d}"
                self.best = {
                    "metric": c.keep_best,
                    "mode": c.keep_best_mode,
                    "value": value,
                    "update": update,
                    "checkpoint": name.name,
                }
                improved = True
        flag = all_reduce_sum(torch.tensor(float(improved)), self.dist)
        return bool(flag.item() > 0)

    def save_rollout(self, update: int, source: BatchSource) -> None:
        """`checkpoint.save_rollouts`: the batch of update `update` (1-based) to
        rollouts/update-N.pt + .json (rank 0; `uniweave.train.state.artifacts`)."""
        if not (self.c.save_rollouts and self.dist.is_main):
            return
        found = source.rollout_record(update - 1)
        if found is None:
            raise TrainingError("checkpoint.save_rollouts: the batch source samples no rollouts")
        trajs, record = found
        entries = artifacts.write_rollout(self.run_dir, update, trajs, record)
        self.rollout_files.update(entries)

    def resume(self, found: ckpt.Checkpoint) -> None:
        """Every rank: the best record of checkpoint `found` (with `keep_best`)."""
        if self.c.keep_best is not None:
            self.best = found.state.get("best")

    def resume_files(self, found: ckpt.Checkpoint) -> None:
        """Rank 0, resuming from `found` in place: rewrite ``best.json`` from its record;
        delete the rollout files of updates after it and refuse when those it links no
        longer match its inventory."""
        if self.c.keep_best is not None:
            artifacts.write_best(ckpt.checkpoint_dir(self.run_dir), self.best)
        if not self.c.save_rollouts:
            return
        artifacts.truncate_rollouts(self.run_dir, found.update)
        entries = artifacts.rollout_inventory(self.run_dir, found.update)
        recorded = found.state.get("rollouts", {}).get("inventory_sha256")
        if recorded != artifacts.inventory_sha256(entries):
            raise TrainingError(
                f"refusing to resume {found.path}: {self.run_dir / artifacts.ROLLOUTS} no "
                "longer holds the rollout files this checkpoint links (missing or changed); "
                "use a new run.output_dir"
            )
        self.rollout_files = entries

    def clear_rollouts(self) -> None:
        """Rank 0, on a fresh start (or a child's): delete any rollout files."""
        artifacts.truncate_rollouts(self.run_dir, 0)
