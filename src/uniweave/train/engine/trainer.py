"""The one training loop shared by SFT, GRPO and OPD.

What varies between methods is behind the two interfaces of `engine.protocols`: a
`BatchSource` (where an update's global batch comes from, deterministically from the
update number) and an `Objective` (a micro-batch's loss normalised by a *global* count,
plus metric sums it `finalize`s). The two never see each other: the trainer only passes
batches and sums.

Everything else — micro-batching and accumulation (`engine.batching`), data parallelism
(DDP / FSDP2, `uniweave.train.dist.parallel`), clipping, AdamW + schedule, atomic
checkpoints with exact resume, JSONL/TensorBoard metrics, the progress bar or plain log
lines — lives here once.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

from uniweave.config import ConfigError, UniweaveConfig, config_hash, resume_conflicts
from uniweave.config.hashing import SCHEDULE_KEYS, check_extension, diff_configs, resumable_summary
from uniweave.config.trainer import TrainerConfig
from uniweave.core.trajectory import TrajectoryBatch
from uniweave.models.base import UnifiedModel
from uniweave.train.dist.comm import DistInfo, all_reduce_sum, barrier
from uniweave.train.dist.parallel import Parallel
from uniweave.train.engine.batching import pack, rank_micro_batches
from uniweave.train.engine.faults import inject_fault, perturb_for_test
from uniweave.train.engine.metrics import (
    MetricsLogger,
    Progress,
    interactive,
    truncate_metrics,
    truncate_tensorboard,
)
from uniweave.train.engine.optim import build_scheduler
from uniweave.train.engine.protocols import BatchSource, Objective
from uniweave.train.state import artifacts, sharded
from uniweave.train.state import checkpoint as ckpt
from uniweave.train.state.fingerprints import FINGERPRINTS, check_fingerprints, input_fingerprints


class TrainingError(RuntimeError):
    """Training cannot continue (non-finite loss, refused resume, ...)."""


SAMPLES_PER_LOG = 4


def autocast(cfg: TrainerConfig, device: torch.device):
    """The forward's precision context (`trainer.precision`)."""
    if cfg.precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return nullcontext()


def check_resume(found: ckpt.Checkpoint, cfg: UniweaveConfig) -> None:
    """ConfigError (a usage error) naming the changed keys when the config `found` was
    saved under may not be resumed under `cfg` (`uniweave.config.resume_conflicts`, and
    `check_extension` under `epoch_extension`), or naming the file when an input it
    recorded changed since (`check_fingerprints`)."""
    check_fingerprints(found.state.get(FINGERPRINTS), cfg, str(found.path))
    if found.state.get("config_hash") == config_hash(cfg):
        return
    saved = found.state.get("config", {})
    refused = resume_conflicts(saved, cfg)
    if refused:
        mode = cfg.checkpoint.resume_mode
        schedule = [
            k for k in refused if any(k == p or k.startswith(p + ".") for p in SCHEDULE_KEYS)
        ]
        fix = "use a new run.output_dir for a new run"
        if schedule and mode == "strict":
            fix = (
                f"to extend or reschedule this run ({', '.join(schedule)}), set "
                "checkpoint.resume_mode: allow_schedule_changes "
                f"(checkpoint.resume_mode=allow_schedule_changes on the command line); else {fix}"
            )
        raise ConfigError(
            f"refusing to resume: the config changed at {', '.join(refused)} "
            f"(checkpoint.resume_mode={mode} allows only {resumable_summary(mode)} to "
            f"change); {fix}",
            source=str(found.path),
        )
    bad = check_extension(saved, cfg)
    if bad is not None:
        raise ConfigError(f"refusing to resume {found.path}: {bad[1]}", key=bad[0])


def draws_dropout(model: nn.Module) -> bool:
    """Whether a training-mode forward of `model` draws dropout masks from the global torch
    RNG (a dropout module with p > 0, LoRA's included, or `attention_dropout` > 0)."""
    for m in model.modules():
        if isinstance(m, nn.Dropout) and m.p > 0:
            return True
        if float(getattr(m, "attention_dropout", 0.0) or 0.0) > 0:
            return True
    return False


def check_world_size_change(found: ckpt.Checkpoint, world_size: int, model: nn.Module) -> None:
    """ConfigError when checkpoint `found`, written at another world size, cannot be
    resumed at `world_size` with the same logical schedule. The data cursor (the update
    number), the global batch and every per-row seed are functions of the update alone,
    and the objective is normalised by global counts, so only one thing depends on the rank
    count: dropout masks, drawn from each rank's own torch RNG stream in the order of its
    micro-batches (which rows a rank holds changes with the world size)."""
    saved = found.state.get("world_size")
    if saved is None or saved == world_size or not draws_dropout(model):
        return
    raise ConfigError(
        f"refusing to resume {found.path} at world size {world_size}: it was written at "
        f"{saved} and the model draws dropout masks from each rank's RNG stream, so the rows' "
        f"masks would depend on the rank count; resume at {saved} ranks or train without "
        "dropout",
        source=str(found.path),
    )


def parent_checkpoint(cfg: UniweaveConfig) -> ckpt.Checkpoint:
    """The checkpoint `run.parent` names: a checkpoint directory (verified), or a run
    directory's newest intact checkpoint. ConfigError naming `run.parent` otherwise, and
    for a checkpoint inside a GRPO round (`algorithm.updates_per_batch` K > 1, update not
    a multiple of K: the round's rollouts stay in the parent's directory; not built)."""
    root = Path(cfg.run.parent)
    try:
        if (root / ckpt.STATE).is_file():
            found: ckpt.Checkpoint | None = ckpt.verify_checkpoint(root)
        elif not ckpt.checkpoint_dir(root).is_dir():
            raise ConfigError(f"{root}: neither a run directory nor a checkpoint", key="run.parent")
        else:
            found = ckpt.scan_checkpoints(root).latest
    except ckpt.CheckpointError as exc:
        raise ConfigError(f"{exc}", key="run.parent") from None
    if found is None:
        raise ConfigError(f"{root}: no intact checkpoint", key="run.parent")
    k = getattr(cfg.algorithm, "updates_per_batch", 1)
    if found.update % k:
        raise ConfigError(
            f"{found.path}: update {found.update} is inside a GRPO round "
            f"(algorithm.updates_per_batch={k}); a child starts only at a round boundary "
            "(a multiple of it)",
            key="run.parent",
        )
    return found


def parent_record(found: ckpt.Checkpoint) -> dict[str, str]:
    """What a child run records of its parent checkpoint: its path and the SHA-256 of its
    manifest (every file's size and SHA-256, canonical JSON)."""
    manifest = json.dumps(found.state["manifest"], sort_keys=True, separators=(",", ":"))
    return {
        "checkpoint": str(found.path.resolve()),
        "manifest_sha256": hashlib.sha256(manifest.encode()).hexdigest(),
        "update": str(found.update),
    }


def gradient_diagnostics(
    first: list[torch.Tensor | None], second: list[torch.Tensor | None], names: tuple[str, str]
) -> dict[str, float]:
    """Pre-clip L2 norms of two gradients (per-parameter lists, None = zero), the ratio
    of the first's to the second's and their cosine, in float64 (docs/numerics.md §9).
    Ratio and cosine are left out when either norm is 0 (an update without rows of a
    part)."""
    zero = torch.zeros((), dtype=torch.float64)
    sq_a, sq_b, dot = zero, zero, zero
    for a, b in zip(first, second):
        a64 = None if a is None else a.detach().double()
        b64 = None if b is None else b.detach().double()
        if a64 is not None:
            sq_a = sq_a + a64.pow(2).sum().cpu()
        if b64 is not None:
            sq_b = sq_b + b64.pow(2).sum().cpu()
        if a64 is not None and b64 is not None:
            dot = dot + (a64 * b64).sum().cpu()
    sq_a, sq_b, dot = torch.stack([sq_a, sq_b, dot]).tolist()
    na, nb = math.sqrt(sq_a), math.sqrt(sq_b)
    x, y = names
    out = {f"grad/{x}_norm": na, f"grad/{y}_norm": nb}
    if na > 0 and nb > 0:
        out[f"grad/{x}_to_{y}_norm_ratio"] = na / nb
        out[f"grad/{x}_{y}_cosine"] = dot / (na * nb)
    return out


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
        (e.g. OPD's teacher path and content hash) is written into every checkpoint, and
        a checkpoint holding another identity is not resumed."""
        self.model = model
        self.source = source
        self.objective = objective
        self.cfg = cfg
        self.t = cfg.trainer
        self.run_dir = Path(run_dir)
        self.dist = dist_info
        self.pad_id = pad_id
        self._trainable_state = trainable_state or self._full_state
        self._ckpt_keys = set(self._trainable_state())
        frozen = objective.frozen_models()
        self.parallel = Parallel(model, self.t, dist_info, frozen)
        perturb_for_test(model, dist_info.rank)
        self.named_params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in self.named_params]
        self._grads_checked = False
        self.evaluator = evaluator
        self.identity = objective.identity
        opt, sched = self.t.optimizer, self.t.scheduler
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=opt.lr,
            betas=tuple(opt.betas),
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
        self.config_hash = config_hash(cfg)
        self.update = 0
        self.resumed_from: Path | None = None
        self.best: dict[str, Any] | None = None  # checkpoint.keep_best (rank 0)
        self._rollout_files: dict[str, tuple[int, str]] = {}  # checkpoint.save_rollouts
        self.parent: dict[str, str] | None = None  # the run.parent checkpoint started from
        self.from_parent = False  # this start loaded the parent (not an own checkpoint)
        self._fingerprints: dict | None = None
        # world-size and execution-only config changes met on resume (checkpoint record)
        self.execution_changes: list[dict[str, Any]] = []
        self._batch_seconds = 0.0
        self._last_ckpt_time = time.monotonic()

    def _full_state(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    # -- checkpoints ---------------------------------------------------------------
    def save(self) -> None:
        """Checkpoint `self.update`: every rank writes its RNG state (and under ddp/fsdp2
        its DCP shards) into the staging directory, then rank 0 commits it (DDP: after
        the replicas' parameters were found identical)."""
        staging = ckpt.staging_dir(self.run_dir, self.update)
        self.parallel.check_replicas(dict(self.named_params), "parameter")
        barrier(self.dist)
        ckpt.write_rank_rng(staging, self.dist.rank)
        state = {
            "config_hash": self.config_hash,
            "config": self.cfg.model_dump(mode="json"),
            "data_cursor": self.update,
            "world_size": self.dist.world_size,
            "execution_changes": self.execution_changes,
            "optimizer_saved": bool(self.optimizer.state) or not self.parallel.distributed,
            **({"identity": self.identity} if self.identity is not None else {}),
            **({"best": self.best} if self.best is not None else {}),
            **({"parent": self.parent} if self.parent is not None else {}),
        }
        if self.cfg.checkpoint.save_rollouts:
            state["rollouts"] = {
                "files": sorted(self._rollout_files),
                "inventory_sha256": artifacts.inventory_sha256(self._rollout_files),
            }
        if self.dist.is_main:
            if self._fingerprints is None:  # what the run reads, fingerprinted once
                self._fingerprints = input_fingerprints(self.cfg)
            state[FINGERPRINTS] = self._fingerprints
        if self.parallel.distributed:
            sharded.save_sharded(
                staging, self.model, self.optimizer, self.scheduler, self._ckpt_keys, self.dist
            )
        barrier(self.dist)
        if self.dist.is_main:
            inject_fault("checkpoint_write", self.update)
            keep = self.cfg.checkpoint.keep_last
            if self.parallel.distributed:
                ckpt.seal_checkpoint(self.run_dir, self.update, state, keep)
            else:
                opt = {
                    "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(),
                }
                objective_state = self.objective.state_dict()
                if objective_state is not None:  # e.g. SFT's EMA shadow
                    opt["objective"] = objective_state
                model_state = self._trainable_state()
                ckpt.commit_checkpoint(self.run_dir, self.update, model_state, opt, state, keep)
        barrier(self.dist)
        self._last_ckpt_time = time.monotonic()

    def resume(self) -> bool:
        """Load the latest intact checkpoint of the run directory, else (with `run.parent`)
        the parent checkpoint; return whether one was loaded. Says which on stdout."""
        scan = ckpt.scan_checkpoints(self.run_dir)
        found = scan.latest
        parent = self.cfg.run.parent
        if found is None and parent is not None:
            found = parent_checkpoint(self.cfg)
            self.from_parent = True
        if found is not None:
            self._check_config(found)
        barrier(self.dist)
        if self.dist.is_main:
            ckpt.tidy_run_dir(self.run_dir, scan)
        barrier(self.dist)
        if found is None:
            return False
        self.parent = parent_record(found) if self.from_parent else found.state.get("parent")
        if self.dist.is_main and parent is not None:
            if self.from_parent:
                print(f"starting from the parent checkpoint {found.path} (run.parent)", flush=True)
            else:
                print(
                    f"resuming from this run's own checkpoint {found.path} (not the "
                    f"run.parent {parent})",
                    flush=True,
                )
        if found.sharded != self.parallel.distributed:
            raise TrainingError(
                f"{found.path}: written {'with' if found.sharded else 'without'} "
                "torch.distributed.checkpoint; resume it under the trainer.parallel it was "
                "written with"
            )
        if self.parallel.distributed:
            sharded.load_sharded(
                found.path,
                self.model,
                self.optimizer,
                self.scheduler,
                self._ckpt_keys,
                self.dist,
                with_optim=found.state.get("optimizer_saved", True),
            )
        else:
            self._load_single(found)
        saved_world = found.state.get("world_size")
        rank = self.dist.rank if saved_world in (None, self.dist.world_size) else 0
        if (found.path / f"rng-rank{rank}.pt").is_file():
            ckpt.restore_rng_states(found.rng_state(rank))
        self.update = found.update
        self.resumed_from = found.path
        self._record_execution_change(found)
        if self.from_parent:  # a child starts without metrics, best record or rollouts
            return True
        if self.cfg.checkpoint.keep_best is not None:
            self.best = found.state.get("best")
        if self.dist.is_main:
            truncate_metrics(self.run_dir / "metrics.jsonl", self.update)
            truncate_tensorboard(self.run_dir, self.update)
            if self.cfg.checkpoint.keep_best is not None:
                artifacts.write_best(ckpt.checkpoint_dir(self.run_dir), self.best)
            if self.cfg.checkpoint.save_rollouts:
                self._resume_rollouts(found)
        return True

    def _record_execution_change(self, found: ckpt.Checkpoint) -> None:
        """Carry the checkpoint's record of execution changes and add this resume's, when
        the world size or (resuming in place) an allowed config key differs from the
        checkpoint's; rank 0 says so. Only changes the resume check let through reach
        here, so a logical change is never recorded: it was refused."""
        self.execution_changes = list(found.state.get("execution_changes", []))
        before = found.state.get("world_size")
        # a child's config differs from its parent's by design (its own record: "parent")
        keys = [] if self.from_parent else diff_configs(found.state.get("config", {}), self.cfg)
        moved = before is not None and before != self.dist.world_size
        if not moved and not keys:
            return
        entry = {
            "update": found.update,
            "checkpoint": found.path.name,
            "world_size": [before, self.dist.world_size],
            "config_keys": keys,
        }
        self.execution_changes.append(entry)
        if self.dist.is_main:
            what = [f"world size {before} -> {self.dist.world_size}"] if moved else []
            what += [f"config {', '.join(keys)}"] if keys else []
            print(
                f"execution change at update {found.update}: {'; '.join(what)} (the same "
                "updates, computed in another order: float rounding, not bit for bit)",
                flush=True,
            )

    def _resume_rollouts(self, found: ckpt.Checkpoint) -> None:
        """Delete the rollout files of updates after the checkpoint; refuse when those it
        links no longer match its inventory (`uniweave.train.state.artifacts`)."""
        artifacts.truncate_rollouts(self.run_dir, self.update)
        entries = artifacts.rollout_inventory(self.run_dir, self.update)
        recorded = found.state.get("rollouts", {}).get("inventory_sha256")
        if recorded != artifacts.inventory_sha256(entries):
            raise TrainingError(
                f"refusing to resume {found.path}: {self.run_dir / artifacts.ROLLOUTS} no "
                "longer holds the rollout files this checkpoint links (missing or changed); "
                "use a new run.output_dir"
            )
        self._rollout_files = entries

    def _load_single(self, found: ckpt.Checkpoint) -> None:
        missing, unexpected = self.model.load_state_dict(found.model_state(), strict=False)
        if unexpected or (missing and self._trainable_state == self._full_state):
            raise TrainingError(
                f"{found.path}: checkpoint does not fit the model "
                f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
            )
        opt = found.optimizer_state()
        self.optimizer.load_state_dict(opt["optimizer"])
        self.scheduler.load_state_dict(opt["scheduler"])
        if not self.from_parent:  # a child run starts its objective state afresh
            self.objective.load_state_dict(opt.get("objective"))

    def _check_config(self, found: ckpt.Checkpoint) -> None:
        held = found.state.get("identity")
        if held != self.identity:
            raise TrainingError(
                f"refusing to resume {found.path}: it was trained against {held}, this run "
                f"has {self.identity}; use a new run.output_dir"
            )
        check_resume(found, self.cfg)
        check_world_size_change(found, self.dist.world_size, self.model)

    def _remeasures(self) -> bool:
        """A child started from its parent under `rollout_limit_change` re-measures the
        validation metrics at the update it starts from (rank 0, when it validates)."""
        return (
            self.from_parent
            and self.cfg.checkpoint.resume_mode == "rollout_limit_change"
            and self.evaluator is not None
            and (self.t.eval_every > 0 or self.t.eval_every_epochs > 0)
        )

    # -- one update ----------------------------------------------------------------
    def accumulate(self) -> dict[str, float]:
        """Gradients of update `self.update`'s global objective, summed over this rank's
        micro-batches and then over ranks (left in `.grad`), and the update's metrics
        (`objective.finalize` of the all-reduced sums). Raises TrainingError on a
        non-finite loss, leaving the gradients cleared."""
        t0 = time.perf_counter()
        trajs = self.parallel.gathered(lambda: self.source.global_batch(self.update))
        self._batch_seconds = time.perf_counter() - t0
        groups, boundary = self._micro_groups(trajs)
        collate = pack if self.t.packing else TrajectoryBatch.collate
        micros = [collate(g, self.pad_id).to(self.model.device) for g in groups]
        # `count` may read a frozen model (OPD's carriers: the teacher), sharded under fsdp2
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
                first = self._take_grads()
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
        if boundary is not None:
            first = self._take_grads() if first is None else first
            second = self._take_grads()
            diagnostics = gradient_diagnostics(first, second, self.objective.gradient_parts)
            for p, a, b in zip(self.params, first, second):
                p.grad = a if b is None else b if a is None else a + b
        self.parallel.drop_unreached(self.params)
        if not self._grads_checked:
            grads = {n: p.grad for n, p in self.named_params if p.grad is not None}
            self.parallel.check_replicas(grads, "gradient")
            self._grads_checked = True
        keys = sorted(sums)
        flat = torch.tensor([sums[k] for k in keys] + [float(total), n_tokens], dtype=torch.float64)
        flat = all_reduce_sum(flat, self.dist).tolist()
        metrics = self.objective.finalize(dict(zip(keys, flat)), n_global)
        metrics["loss"] = flat[-2]
        metrics["n_scored"] = float(n_global)
        metrics["tokens"] = flat[-1]
        metrics.update(diagnostics)
        return metrics

    def _micro_groups(self, trajs: list) -> tuple[list[list], int | None]:
        """This rank's micro-batches and, on an update that logs gradient diagnostics,
        the index of the first micro-batch of the objective's second gradient part.
        With `logging.gradient_diagnostics_every_updates` > 0 every update micro-batches
        the two parts apart (first part's rows, then the second's; the loss is additive
        over any split), so a micro-batch's one backward adds to one part only."""
        every = self.cfg.logging.gradient_diagnostics_every_updates
        parts = self.objective.gradient_parts
        if every == 0 or parts is None:
            return rank_micro_batches(trajs, self.dist, self.t), None
        second = [self.objective.in_second_part(t) for t in trajs]
        head = rank_micro_batches([t for t, s in zip(trajs, second) if not s], self.dist, self.t)
        tail = rank_micro_batches([t for t, s in zip(trajs, second) if s], self.dist, self.t)
        return head + tail, len(head) if (self.update + 1) % every == 0 else None

    def _take_grads(self) -> list[torch.Tensor | None]:
        """The trainable parameters' `.grad` (the gradient accumulated so far), which are
        then cleared so that the next backward starts a new accumulation."""
        grads = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        return grads

    def step(self) -> dict[str, float]:
        """Run update `self.update`: accumulate, clip, step the optimizer and schedule."""
        t0 = time.perf_counter()
        metrics = self.accumulate()
        grad_norm, clip_scale = self.parallel.clip(self.params, self.t.grad_clip or 0.0)
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise TrainingError(f"non-finite gradient norm at update {self.update + 1}; stopping")
        lr = self.scheduler.get_last_lr()[0]
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

    def _track_best(self, metrics: dict[str, float], evaluated: bool) -> bool:
        """`checkpoint.keep_best`: whether this evaluated update improves the best value
        (rank 0 decides, every rank learns it); the new record goes into `self.best`."""
        c = self.cfg.checkpoint
        if c.keep_best is None or not evaluated:
            return False
        improved = False
        if self.evaluator is not None and self.dist.is_main:
            if c.keep_best not in metrics:
                found = ", ".join(sorted(k for k in metrics if k.startswith("val/")))
                raise TrainingError(
                    f"checkpoint.keep_best: {c.keep_best} is not among the validation "
                    f"metrics of update {self.update} ({found})"
                )
            value = float(metrics[c.keep_best])
            if math.isfinite(value) and artifacts.better(value, self.best, c.keep_best_mode):
                name = ckpt.checkpoint_dir(self.run_dir) / f"{ckpt.PREFIX}{self.update:06d}"
                self.best = {
                    "metric": c.keep_best,
                    "mode": c.keep_best_mode,
                    "value": value,
                    "update": self.update,
                    "checkpoint": name.name,
                }
                improved = True
        flag = all_reduce_sum(torch.tensor(float(improved)), self.dist)
        return bool(flag.item() > 0)

    def _save_rollout(self) -> None:
        """`checkpoint.save_rollouts`: the batch of update `self.update` (1-based) to
        rollouts/update-N.pt + .json (rank 0; `uniweave.train.state.artifacts`)."""
        if not (self.cfg.checkpoint.save_rollouts and self.dist.is_main):
            return
        found = self.source.rollout_record(self.update - 1)
        if found is None:
            raise TrainingError("checkpoint.save_rollouts: the batch source samples no rollouts")
        trajs, record = found
        entries = artifacts.write_rollout(self.run_dir, self.update, trajs, record)
        self._rollout_files.update(entries)

    def _due(self) -> bool:
        c = self.cfg.checkpoint
        if self.update >= self.t.total_updates:
            return True
        if c.every_updates > 0 and self.update % c.every_updates == 0:
            return True
        if self._epoch_boundary(c.every_epochs):
            return True
        due = c.every_minutes > 0 and (
            time.monotonic() - self._last_ckpt_time >= 60.0 * c.every_minutes
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
        if not resumed or self.from_parent:
            if self.dist.is_main:
                truncate_metrics(self.run_dir / "metrics.jsonl", -1)
                truncate_tensorboard(self.run_dir, 0)
                artifacts.truncate_rollouts(self.run_dir, 0)
            # the step-zero checkpoint before the first update, or a child's first
            # checkpoint: the parent's state, in its own directory
            self.save()
        if self.dist.is_main:
            if resumed:
                print(
                    f"resumed from update {self.update} ({self.resumed_from}); "
                    f"{self.t.total_updates - self.update} updates to go",
                    flush=True,
                )
            else:
                print(f"training {self.t.total_updates} updates into {self.run_dir}", flush=True)
        log = self.cfg.logging
        logger = None
        if self.dist.is_main:
            logger = MetricsLogger(self.run_dir, log, self.cfg.model_dump(mode="json"))
        total = self.t.total_updates
        main = self.dist.is_main
        progress = Progress(
            total, self.update, log.progress_bar and main, plain=main and not interactive()
        )
        start = self.update
        if self._remeasures():
            # rollout caps changed from the parent: the validation baseline under the new
            # caps (every rank that has an evaluator runs it: under ddp it is shared)
            baseline = self.evaluator(self.update)
            if logger is not None:
                logger.log(self.update, baseline, force=True)
        try:
            while self.update < total:
                t0 = time.perf_counter()
                metrics = self.step()
                self.update += 1
                self._save_rollout()
                evaluated = self._eval_due()
                if self.evaluator is not None and evaluated:
                    metrics.update(self.evaluator(self.update))
                improved = self._track_best(metrics, evaluated)
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
