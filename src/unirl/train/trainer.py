"""The one training loop shared by SFT, GRPO and OPD.

What varies between methods is behind two small interfaces:

- a `BatchSource` says where an update's global batch comes from (a dataset cursor for
  SFT, rollouts for GRPO/OPD) — deterministically from the update number, so a resumed
  or retried update sees exactly the same batch;
- an `Objective` turns a micro-batch into a loss normalised by a *global* count.

Everything else — micro-batching and accumulation, gradient sum across ranks, clipping,
AdamW + schedule, atomic checkpoints with exact resume, JSONL/TensorBoard metrics, the
progress bar — lives here once.
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from unirl.config.schema import LoggingConfig
from unirl.core.trajectory import Trajectory, TrajectoryBatch
from unirl.models.base import UnifiedModel
from unirl.train import checkpoint as ckpt
from unirl.train.distributed import DistInfo, all_reduce_sum, barrier, sum_gradients
from unirl.train.metrics import MetricsLogger, Progress, truncate_metrics
from unirl.train.optim import build_scheduler, clip_gradients

FAULT_ENV = "UNIRL_FAULT"


class TrainingError(RuntimeError):
    """Training cannot continue (non-finite loss, refused resume, ...)."""


class BatchSource(Protocol):
    def global_batch(self, update: int) -> list[Trajectory]:
        """The trajectories of update `update` (the same on every rank and every retry)."""

    def batch_metrics(self, update: int) -> dict[str, float]:
        """Metrics of producing update `update`'s batch (rewards, rollout speed, ...)."""


class Objective(Protocol):
    def count(self, batch: TrajectoryBatch) -> int:
        """This shard's contribution to the global normaliser."""

    def loss(
        self, model: UnifiedModel, micro: TrajectoryBatch, n_global: int, update: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The micro-batch's share of the global loss and metric *sums* for logging."""


@dataclass
class TrainerSettings:
    """The trainer knobs, read from the run config by the job that builds the trainer."""

    total_updates: int
    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    eps: float = 1e-8
    scheduler: str = "constant"
    warmup_updates: int = 0
    min_lr_ratio: float = 0.0
    micro_batch_size: int = 8
    micro_batch_tokens: int = 0
    grad_clip: float = 1.0
    precision: str = "fp32"
    checkpoint_every: int = 0
    checkpoint_minutes: float = 0.0
    keep_last: int = 2
    progress: bool = True
    tensorboard: bool = True
    config_hash: str = ""
    config_dump: dict[str, Any] = field(default_factory=dict)
    resume_check: Callable[[dict[str, Any]], list[str]] | None = None


def micro_batches(trajs: list[Trajectory], size: int, token_budget: int) -> list[list[int]]:
    """Indices of `trajs` per micro-batch: fixed `size` rows, or, with a token budget,
    length-sorted buckets whose padded size (rows × longest row) stays within the budget."""
    if token_budget <= 0:
        return [list(range(i, min(i + size, len(trajs)))) for i in range(0, len(trajs), size)]
    order = sorted(range(len(trajs)), key=lambda i: len(trajs[i]))
    buckets: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = max([len(trajs[j]) for j in current] + [len(trajs[i])])
        if current and longest * (len(current) + 1) > token_budget:
            buckets.append(current)
            current = []
        current.append(i)
    if current:
        buckets.append(current)
    return buckets


def _inject_fault(point: str, update: int) -> None:
    """Test hook: `UNIRL_FAULT=<point>:<update>` SIGKILLs this process at that point."""
    spec = os.environ.get(FAULT_ENV, "")
    if spec and spec == f"{point}:{update}":
        os.kill(os.getpid(), signal.SIGKILL)


class Trainer:
    def __init__(
        self,
        model: UnifiedModel,
        source: BatchSource,
        objective: Objective,
        settings: TrainerSettings,
        run_dir: Path,
        dist_info: DistInfo,
        pad_id: int,
        trainable_state: Any = None,
        evaluator: Callable[[int], dict[str, float]] | None = None,
        eval_every: int = 0,
    ) -> None:
        self.model = model
        self.source = source
        self.objective = objective
        self.s = settings
        self.run_dir = Path(run_dir)
        self.dist = dist_info
        self.pad_id = pad_id
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._trainable_state = trainable_state or self._full_state
        self.evaluator = evaluator
        self.eval_every = eval_every
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=settings.lr,
            betas=settings.betas,
            weight_decay=settings.weight_decay,
            eps=settings.eps,
        )
        self.scheduler = build_scheduler(
            self.optimizer,
            settings.scheduler,
            settings.warmup_updates,
            settings.total_updates,
            settings.min_lr_ratio,
        )
        self.update = 0
        self._last_ckpt_time = time.monotonic()

    def _full_state(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    # -- checkpoints ---------------------------------------------------------------
    def save(self) -> None:
        staging = ckpt.staging_dir(self.run_dir, self.update)
        barrier(self.dist)
        ckpt.write_rank_rng(staging, self.dist.rank)
        barrier(self.dist)
        if self.dist.is_main:
            _inject_fault("checkpoint_write", self.update)
            ckpt.commit_checkpoint(
                self.run_dir,
                self.update,
                self._trainable_state(),
                {
                    "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(),
                },
                {
                    "config_hash": self.s.config_hash,
                    "config": self.s.config_dump,
                    "data_cursor": self.update,
                },
                self.s.keep_last,
            )
        barrier(self.dist)
        self._last_ckpt_time = time.monotonic()

    def resume(self) -> bool:
        """Load the latest intact checkpoint, if any; return whether one was found."""
        if self.dist.is_main:
            ckpt.clear_staging(self.run_dir)
        barrier(self.dist)
        found = ckpt.latest_checkpoint(self.run_dir)
        if found is None:
            return False
        self._check_config(found)
        missing, unexpected = self.model.load_state_dict(found.model_state(), strict=False)
        if unexpected or (missing and self._trainable_state == self._full_state):
            raise TrainingError(
                f"{found.path}: checkpoint does not fit the model "
                f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
            )
        opt = found.optimizer_state()
        self.optimizer.load_state_dict(opt["optimizer"])
        self.scheduler.load_state_dict(opt["scheduler"])
        rank_file = found.path / f"rng-rank{self.dist.rank}.pt"
        if rank_file.is_file():
            ckpt.restore_rng_states(found.rng_state(self.dist.rank))
        self.update = found.update
        if self.dist.is_main:
            truncate_metrics(self.run_dir / "metrics.jsonl", self.update)
        return True

    def _check_config(self, found: ckpt.Checkpoint) -> None:
        if found.state.get("config_hash") == self.s.config_hash:
            return
        saved = found.state.get("config", {})
        refused = self.s.resume_check(saved) if self.s.resume_check else ["<config hash>"]
        if refused:
            raise TrainingError(
                f"refusing to resume {found.path}: the config changed at "
                f"{', '.join(refused)} (checkpoint.resume_mode does not allow it)"
            )

    # -- one update ----------------------------------------------------------------
    def _shard(self, trajs: list[Trajectory]) -> list[Trajectory]:
        return trajs[self.dist.rank :: self.dist.world_size]

    def _autocast(self):
        if self.s.precision == "bf16":
            return torch.autocast(device_type=self.model.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def accumulate(self) -> dict[str, float]:
        """Gradients of update `self.update`'s global objective, summed over this rank's
        micro-batches and then over ranks (left in `.grad`). Raises TrainingError on a
        non-finite loss, leaving the gradients cleared."""
        shard = self._shard(self.source.global_batch(self.update))
        groups = micro_batches(shard, self.s.micro_batch_size, self.s.micro_batch_tokens)
        micros = [TrajectoryBatch.collate([shard[i] for i in g], self.pad_id) for g in groups]
        micros = [m.to(self.model.device) for m in micros]
        local = sum(self.objective.count(m) for m in micros)
        n_global = int(all_reduce_sum(torch.tensor(float(local)), self.dist).item())
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), dtype=torch.float64)
        sums: dict[str, float] = {}
        n_tokens = 0
        for micro in micros:
            with self._autocast():
                loss, metrics = self.objective.loss(self.model, micro, n_global, self.update)
            finite = torch.isfinite(loss.detach()).all().float().view(1)
            if int(all_reduce_sum(finite, self.dist).item()) != self.dist.world_size:
                self.optimizer.zero_grad(set_to_none=True)
                raise TrainingError(
                    f"non-finite loss at update {self.update + 1}; stopping without a checkpoint"
                )
            loss.backward()
            total += loss.detach().double().cpu()
            n_tokens += int(micro.attention_mask.sum())
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + value
        sum_gradients(self.params, self.dist)
        reduced = {k: float(all_reduce_sum(torch.tensor(v), self.dist)) for k, v in sums.items()}
        reduced["loss"] = float(all_reduce_sum(total, self.dist).item())
        reduced["n_scored"] = float(n_global)
        reduced["tokens"] = float(all_reduce_sum(torch.tensor(float(n_tokens)), self.dist))
        return reduced

    def step(self) -> dict[str, float]:
        """Run update `self.update`: accumulate, clip, step the optimizer and schedule."""
        t0 = time.perf_counter()
        metrics = self.accumulate()
        grad_norm, clip_scale = clip_gradients(self.params, self.s.grad_clip)
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise TrainingError(f"non-finite gradient norm at update {self.update + 1}; stopping")
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        seconds = time.perf_counter() - t0
        tokens = metrics.pop("tokens")
        return {
            **self.source.batch_metrics(self.update),
            **metrics,
            "lr": lr,
            "grad_norm": grad_norm,
            "clip_scale": clip_scale,
            "tokens_per_s": tokens / max(seconds, 1e-9),
            "step_seconds": seconds,
        }

    def _due(self) -> bool:
        s = self.s
        if self.update >= s.total_updates:
            return True
        if s.checkpoint_every > 0 and self.update % s.checkpoint_every == 0:
            return True
        due = s.checkpoint_minutes > 0 and (
            time.monotonic() - self._last_ckpt_time >= 60.0 * s.checkpoint_minutes
        )
        flag = all_reduce_sum(torch.tensor(float(due)), self.dist)
        return bool(flag.item() > 0)

    # -- the loop ------------------------------------------------------------------
    def fit(self) -> Iterator[tuple[int, dict[str, float]]]:
        """Resume or start, then train to `total_updates`, yielding (update, metrics)."""
        if self.dist.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        resumed = self.resume()
        if not resumed:
            if self.dist.is_main:
                truncate_metrics(self.run_dir / "metrics.jsonl", -1)
            self.save()
        logger = None
        if self.dist.is_main:
            dump = self.s.config_dump
            log_cfg = LoggingConfig.model_validate(dump.get("logging", {}))
            logger = MetricsLogger(self.run_dir, log_cfg, dump)
        progress = Progress(
            self.s.total_updates, self.update, self.s.progress and self.dist.is_main
        )
        try:
            while self.update < self.s.total_updates:
                t0 = time.perf_counter()
                metrics = self.step()
                self.update += 1
                if self.evaluator is not None and self.eval_every > 0:
                    if self.update % self.eval_every == 0 or self.update == self.s.total_updates:
                        metrics.update(self.evaluator(self.update))
                if logger is not None:
                    last = self.update == self.s.total_updates
                    evaluated = self.evaluator is not None and self.eval_every > 0
                    evaluated = evaluated and self.update % self.eval_every == 0
                    logger.log(self.update, metrics, force=last or evaluated)
                _inject_fault("after_update", self.update)
                if self._due():
                    self.save()
                progress.advance(metrics["loss"], 1.0 / max(time.perf_counter() - t0, 1e-9))
                yield self.update, metrics
        finally:
            progress.close()
            if logger is not None:
                logger.close()
