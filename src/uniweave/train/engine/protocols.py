"""The two interfaces between the shared training loop and a method.

- a `BatchSource` says where an update's global batch comes from (a dataset cursor for
  SFT, rollouts for GRPO/OPD) — deterministically from the update number, so a resumed
  or retried update sees exactly the same batch — and attaches to each row what the
  objective needs (advantages, anchor log-probs, seeds, sampling records);
- an `Objective` turns a micro-batch into a loss normalised by a *global* count plus
  metric sums, and `finalize`s the sums once they are added over micro-batches and
  ranks.

Every member the trainer may call is declared here. Both are abstract base classes: the
members every method must provide are abstract (a subclass that lacks one cannot be
constructed: TypeError naming it), and the optional ones have a default that does
nothing, so a method overrides only what it needs (the trainer never probes a source or
objective with `getattr`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from uniweave.core.trajectory import Trajectory, TrajectoryBatch
from uniweave.models.base import UnifiedModel
from uniweave.train.distributed.comm import DistInfo


class BatchSource(ABC):
    logs_samples: bool = False
    """True when `samples` returns rows to log (rollout sources)."""

    @abstractmethod
    def global_batch(self, update: int) -> Sequence[Trajectory]:
        """The trajectories of update `update` (the same on every rank and every retry),
        each carrying the per-row data its objective needs (advantages, anchors, ...)."""

    @abstractmethod
    def batch_metrics(self, update: int) -> dict[str, float]:
        """Metrics of producing update `update`'s batch (rewards, rollout speed, ...)."""

    def samples(self, update: int, n: int) -> list[dict[str, Any]]:
        """Up to `n` rows of update `update` to log (prompt, response, reward, image);
        read only when `logs_samples` is true."""
        return []

    def epochs_done(self, update: int) -> int | None:
        """Whole epochs of the training rows consumed by the batches of updates
        0..`update`-1 (None: the source has no single epoch; the config refuses epoch
        cadences for it)."""
        return None

    def rollout_record(self, update: int) -> tuple[Sequence[Trajectory], dict[str, Any]] | None:
        """Update `update`'s sampled trajectories and a JSON-able per-row record
        (rewards, advantages, routing, replay selection) for `checkpoint.save_rollouts`;
        None for a source that samples nothing."""
        return None

    def close(self) -> None:
        """Release what the source holds beyond the run (rollout/reward workers)."""
        return None


class Objective(ABC):
    identity: dict[str, str] | None = None
    """What besides the config a checkpoint must match to be resumed (e.g. OPD's teacher
    path and content hash); written into every checkpoint."""

    gradient_parts: tuple[str, str] | None = None
    """Names of two additive parts of the loss whose gradients
    `logging.gradient_diagnostics_every_updates` compares (OPD: distillation and GT
    replay); `in_second_part` says which part a row's loss belongs to."""

    def in_second_part(self, traj: Trajectory) -> bool:
        """Whether row `traj`'s loss belongs to the second of `gradient_parts`."""
        return False

    @abstractmethod
    def count(self, batch: TrajectoryBatch) -> int:
        """This shard's contribution to the global normaliser."""

    @abstractmethod
    def loss(
        self, model: UnifiedModel, micro: TrajectoryBatch, n_global: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The micro-batch's share of the global loss, and metric *sums* of the
        micro-batch (additive over micro-batches and ranks; the same keys every call)."""

    @abstractmethod
    def finalize(self, sums: dict[str, float], n_global: int) -> dict[str, float]:
        """The logged metrics of an update from its `loss` sums, added over every
        micro-batch and all-reduced over ranks."""

    def begin_update(self, update: int, micros: list[TrajectoryBatch], dist: DistInfo) -> None:
        """Called once per update before the micro-batches (on every rank, with this
        rank's micro-batches): an objective whose loss needs the update number or a
        global count besides `count` (SFT with Information Gain) sets them here."""
        return None

    def after_step(self) -> None:
        """Called after every optimizer step (SFT's EMA Necessity distillation updates its
        EMA shadow here)."""
        return None

    def state_dict(self) -> dict[str, Any] | None:
        """State the objective carries across updates that a checkpoint must hold to
        resume exactly (None: nothing; SFT's EMA shadow)."""
        return None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore `state_dict` from a checkpoint (None: the checkpoint held none)."""
        if state is not None:
            raise ValueError(f"{type(self).__name__} keeps no state, the checkpoint has one")

    def frozen_models(self) -> list[nn.Module]:
        """Models the loss reads but never trains (a reference, a teacher), which a
        sharded data-parallel wrapper shards too."""
        return []
