"""The one training loop shared by every method.

What varies between methods is behind the two interfaces of `engine.protocols`: a
`BatchSource` (where an update's global batch comes from, deterministically from the
update number) and an `Objective` (a micro-batch's loss normalised by a *global* count,
plus metric sums it `finalize`s). The two never see each other: the trainer only passes
batches and sums.

The trainer trains: it accumulates an update's gradients over micro-batches
(`engine.batching`) and ranks (DDP / FSDP2, `uniweave.train.distributed.parallel`), clips, steps
AdamW and the schedule, decides when to evaluate, checkpoint and log (JSONL/TensorBoard
metrics, samples, the progress bar or plain log lines). What it keeps and restores lives
beside it: checkpoints and resuming (`engine.checkpointing`), the resume and campaign
policy (`engine.resume`), the best checkpoint and the rollout archive
(`engine.retention`), and the gradient diagnostics (`engine.diagnostics`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from uniweave.config import UniweaveConfig
from uniweave.config.methods import method
from uniweave.core.status import status
from uniweave.core.trajectory import TrajectoryBatch
from uniweave.models.base import UnifiedModel
from uniweave.train.distributed.comm import DistInfo, all_reduce_sum
from uniweave.train.distributed.parallel import Parallel
from uniweave.train.engine.batching import pack
from uniweave.train.engine.checkpointing import Checkpointer
from uniweave.train.engine.diagnostics import merge_parts, part_micro_batches, take_grads
from uniweave.train.engine.errors import TrainingError
from uniweave.train.engine.faults import inject_fault, perturb_for_test
from uniweave.train.engine.forward_mode import autocast
from uniweave.train.engine.metrics import (
    MetricsLogger,
    Progress,
    interactive,
    truncate_metrics,
    truncate_tensorboard,
)
from uniweave.train.engine.optim import build_scheduler
from uniweave.train.engine.protocols import BatchSource, Objective
from uniweave.train.engine.resume import remeasures
from uniweave.train.engine.retention import Retention

SAMPLES_PER_LOG = 4


class Trainer:
    def __init__(
        self,
        model: UnifiedModel,
        source: BatchSource,
        objective: Objective,
        cfg: UniweaveConfig,
        run_dir: Path,
        dist_info: DistInfo,
        pad_id: int,
        trainable_state: Any = None,
        evaluator: Callable[[int], dict[str, float]] | None = None,
    ) -> None:
        """`cfg` is the run config: the trainer reads its `trainer`, `checkpoint` and
        `logging` sections (and hashes the whole of it for resume checks). `objective.identity`
        (e.g. a teacher's path and content hash) is written into every checkpoint, and
        a checkpoint holding another identity is not resumed."""
        self.model = model
        self.source = source
        self.objective = objective
        self.cfg = cfg
        self.t = cfg.trainer
        self.run_dir = Path(run_dir)
        self.dist = dist_info
        self.pad_id = pad_id
        keys = set((trainable_state or model.state_dict)())  # before ddp/fsdp2 wrap it
        frozen = objective.frozen_models()
        self.parallel = Parallel(model, self.t, dist_info, frozen)
        perturb_for_test(model, dist_info.rank)
        self.named_params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in self.named_params]
        self._grads_checked = False
        self.evaluator = evaluator
        opt, sched = self.t.optimizer, self.t.scheduler
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=opt.lr,
            betas=(opt.betas[0], opt.betas[1]),
            weight_decay=opt.weight_decay,
            eps=opt.eps,
        )
        self.scheduler = build_scheduler(
            self.optimizer,
            sched.name,
            sched.warmup_steps,
            self.t.total_updates,
            sched.min_lr_ratio,
        )
        self.update = 0
        self.retention = Retention(cfg, self.run_dir, dist_info)
        self.checkpoints = Checkpointer(
            cfg,
            self.run_dir,
            dist_info,
            model,
            self.parallel,
            self.optimizer,
            self.scheduler,
            objective,
            trainable_state,
            keys,
            self.retention,
        )
        self._batch_seconds = 0.0

    def save(self) -> None:
        """Checkpoint `self.update` (`Checkpointer.save`)."""
        self.checkpoints.save(self.update, dict(self.named_params))

    def resume(self) -> bool:
        """Load the latest intact checkpoint of the run directory, else (with `run.parent`)
        the parent checkpoint; return whether one was loaded (`Checkpointer.resume`)."""
        update = self.checkpoints.resume()
        if update is None:
            return False
        self.update = update
        return True

    # -- one update ----------------------------------------------------------------
    def accumulate(self) -> dict[str, float]:
        """Gradients of update `self.update`'s global objective, summed over this rank's
        micro-batches and then over ranks (left in `.grad`), and the update's metrics
        (`objective.finalize` of the all-reduced sums). Raises TrainingError on a
        non-finite loss, leaving the gradients cleared."""
        t0 = time.perf_counter()
        trajs = self.parallel.gathered(lambda: self.source.global_batch(self.update))
        self._batch_seconds = time.perf_counter() - t0
        every = self.cfg.logging.gradient_diagnostics_every_updates
        groups, boundary = part_micro_batches(
            trajs, self.objective, every, self.update, self.dist, self.t
        )
        collate = pack if self.t.packing else TrajectoryBatch.collate
        micros = [collate(g, self.pad_id).to(self.model.device) for g in groups]
        # `count` may read a frozen model (e.g. a teacher), sharded under fsdp2
        local = self.parallel.gathered(lambda: sum(self.objective.count(m) for m in micros))
        n_global = int(all_reduce_sum(torch.tensor(float(local)), self.dist).item())
        self.objective.begin_update(self.update, micros, self.dist)
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), dtype=torch.float64)
        sums: dict[str, float] = {}
        n_tokens = 0
        first: list[torch.Tensor | None] | None = None
        for i, micro in enumerate(micros):
            if i == boundary:
                first = take_grads(self.params)
            with self.parallel.accumulation(last=i == len(micros) - 1):
                with autocast(self.t, self.model.device):
                    loss, stats = self.parallel.run(self.objective.loss, micro, n_global)
                finite = torch.isfinite(loss.detach()).all().float().view(1).cpu()
                if int(all_reduce_sum(finite, self.dist).item()) != self.dist.world_size:
                    self.optimizer.zero_grad(set_to_none=True)
                    raise TrainingError(
                        f"non-finite loss at update {self.update + 1}; stopping without a "
                        "checkpoint"
                    )
                loss.backward()
                inject_fault("update", self.update + 1)
            total += loss.detach().double().cpu()
            n_tokens += int(micro.attention_mask.sum())
            for key, value in stats.items():
                sums[key] = sums.get(key, 0.0) + float(value)
        self.parallel.after_sync(self.params)
        diagnostics: dict[str, float] = {}
        if boundary is not None and self.objective.gradient_parts is not None:
            diagnostics = merge_parts(self.params, first, self.objective.gradient_parts)
        self.parallel.drop_unreached(self.params)
        if not self._grads_checked:
            grads = {n: p.grad for n, p in self.named_params if p.grad is not None}
            self.parallel.check_replicas(grads, "gradient")
            self._grads_checked = True
        keys = sorted(sums)
        flat = torch.tensor([sums[k] for k in keys] + [float(total), n_tokens], dtype=torch.float64)
        summed = all_reduce_sum(flat, self.dist).tolist()
        metrics = self.objective.finalize(dict(zip(keys, summed)), n_global)
        metrics["loss"] = summed[-2]
        metrics["n_scored"] = float(n_global)
        metrics["tokens"] = summed[-1]
        metrics.update(diagnostics)
        return metrics

    def step(self) -> dict[str, float]:
        """Run update `self.update`: accumulate, clip, step the optimizer and schedule."""
        t0 = time.perf_counter()
        metrics = self.accumulate()
        grad_norm, clip_scale = self.parallel.clip(self.params, self.t.grad_clip or 0.0)
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise TrainingError(f"non-finite gradient norm at update {self.update + 1}; stopping")
        lr = float(self.scheduler.get_last_lr()[0])
        self.optimizer.step()
        self.objective.after_step()
        self.scheduler.step()
        seconds = time.perf_counter() - t0
        train_s = seconds - self._batch_seconds
        tokens = metrics.pop("tokens")
        return {
            **self.source.batch_metrics(self.update),
            **metrics,
            "lr": lr,
            "grad_norm": grad_norm,
            "clip_scale": clip_scale,
            "tokens_per_s": tokens / max(seconds, 1e-9),
            "step_seconds": seconds,
            "time/batch_s": self._batch_seconds,
            "time/train_s": train_s,
            "train/tokens_per_s": tokens / max(train_s, 1e-9),
        }

    def _epoch_boundary(self, every: int) -> bool:
        """Whether update `self.update` ends an epoch whose number is a multiple of
        `every` (the update whose batch holds that epoch's last row; `epochs_done`)."""
        if every <= 0:
            return False
        now, before = self.source.epochs_done(self.update), self.source.epochs_done(self.update - 1)
        if now is None or before is None:
            raise TrainingError("epoch cadences need a batch source with epochs (sft)")
        return now // every > before // every

    def _eval_due(self) -> bool:
        """Whether update `self.update` is evaluated: every `trainer.eval_every` updates,
        at every `trainer.eval_every_epochs`-th epoch boundary, and at the last update
        when either is on."""
        every, epochs = self.t.eval_every, self.t.eval_every_epochs
        if every == 0 and epochs == 0:
            return False
        if self.update == self.t.total_updates:
            return True
        return (every > 0 and self.update % every == 0) or self._epoch_boundary(epochs)

    def _due(self) -> bool:
        c = self.cfg.checkpoint
        if self.update >= self.t.total_updates:
            return True
        if c.every_updates > 0 and self.update % c.every_updates == 0:
            return True
        if self._epoch_boundary(c.every_epochs):
            return True
        due = c.every_minutes > 0 and (
            time.monotonic() - self.checkpoints.last_saved >= 60.0 * c.every_minutes
        )
        flag = all_reduce_sum(torch.tensor(float(due)), self.dist)
        return bool(flag.item() > 0)

    def _log_samples(self, logger: MetricsLogger | None) -> None:
        """Every `logging.samples_every` updates, a few of the update's rows (prompt,
        response, reward, decoded image) of a batch source that has them (`samples`).
        Under fsdp2 every rank decodes (the codec may hold sharded weights); rank 0 logs."""
        every = self.cfg.logging.samples_every
        if not self.source.logs_samples or not (every > 0 and self.update % every == 0):
            return
        if not self.parallel.sharded and logger is None:
            return
        rows = self.parallel.gathered(lambda: self.source.samples(self.update - 1, SAMPLES_PER_LOG))
        if logger is not None:
            logger.log_samples(self.update, rows)

    # -- the loop ------------------------------------------------------------------
    def fit(self, stop_after: int | None = None) -> Iterator[tuple[int, dict[str, float]]]:
        """Resume or start, then train to `total_updates`, yielding (update, metrics).
        `stop_after` N: stop after N new updates with a checkpoint of the last one (the
        schedule is unchanged: a re-run continues exactly as an uninterrupted run)."""
        if self.dist.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        resumed = self.resume()
        if not resumed or self.checkpoints.from_parent:
            if self.dist.is_main:
                truncate_metrics(self.run_dir / "metrics.jsonl", -1)
                truncate_tensorboard(self.run_dir, 0)
                self.retention.clear_rollouts()
            # the step-zero checkpoint before the first update, or a child's first
            # checkpoint: the parent's state, in its own directory
            self.save()
        if self.dist.is_main:
            if resumed:
                status(
                    f"resumed from update {self.update} ({self.checkpoints.resumed_from}); "
                    f"{self.t.total_updates - self.update} updates to go"
                )
            else:
                status(f"training {self.t.total_updates} updates into {self.run_dir}")
        log = self.cfg.logging
        logger = None
        if self.dist.is_main:
            logger = MetricsLogger(self.run_dir, log, self.cfg.model_dump(mode="json"))
        total = self.t.total_updates
        main = self.dist.is_main
        plain, shown = main and not interactive(), method(self.cfg.algorithm.name).progress
        progress = Progress(total, self.update, log.progress_bar and main, plain, shown)
        start = self.update
        evaluator = self.evaluator
        if evaluator is not None and remeasures(self.cfg, self.checkpoints.from_parent, True):
            # rollout caps changed from the parent: the validation baseline under the new
            # caps (every rank that has an evaluator runs it: under ddp it is shared)
            baseline = evaluator(self.update)
            if logger is not None:
                logger.log(self.update, baseline, force=True)
        try:
            while self.update < total:
                t0 = time.perf_counter()
                metrics = self.step()
                self.update += 1
                self.retention.save_rollout(self.update, self.source)
                evaluated = self._eval_due()
                if self.evaluator is not None and evaluated:
                    metrics.update(self.evaluator(self.update))
                has_evaluator = self.evaluator is not None
                improved = self.retention.track_best(self.update, metrics, evaluated, has_evaluator)
                if logger is not None:
                    last = self.update == total
                    if logger.log(self.update, metrics, force=last or evaluated):
                        progress.logged(self.update, metrics)
                self._log_samples(logger)
                inject_fault("after_update", self.update)
                stop = stop_after is not None and self.update - start >= stop_after
                if self._due() or stop or improved:
                    self.save()
                progress.advance(metrics["loss"], 1.0 / max(time.perf_counter() - t0, 1e-9))
                yield self.update, metrics
                if stop:
                    return
        finally:
            progress.close()
            if logger is not None:
                logger.close()
