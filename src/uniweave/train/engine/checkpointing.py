"""The trainer's checkpoints: what one holds and how a run resumes from one.

A checkpoint of update u holds the trainable parameters, the optimizer and schedule (and
an objective's own state, `Objective.state_dict`), every rank's RNG state, and a record:
the config and its hash, the data cursor (the update number: every batch is a function of
it), the world size, the execution changes met so far, the objective's identity, the
parent link of a child run, retention's best record and rollout inventory
(`engine.retention`) and the fingerprints of the run's inputs. Single-process runs commit
it through `uniweave.train.state.checkpoint`; under ddp/fsdp2 every rank writes DCP shards
(`uniweave.train.state.sharded`) and rank 0 seals the directory.

`Checkpointer.resume` loads the run directory's newest intact checkpoint, else the
`run.parent` checkpoint (a child's first state, without its parent's objective state,
metrics, best record or rollouts), after the checks of `engine.resume` let it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from uniweave.config import UniweaveConfig, config_hash
from uniweave.core.status import status
from uniweave.models.base import UnifiedModel
from uniweave.train.distributed.comm import DistInfo, barrier
from uniweave.train.distributed.parallel import Parallel
from uniweave.train.engine.errors import TrainingError
from uniweave.train.engine.faults import inject_fault
from uniweave.train.engine.metrics import truncate_metrics, truncate_tensorboard
from uniweave.train.engine.protocols import Objective
from uniweave.train.engine.resume import (
    check_identity,
    check_resume,
    check_world_size_change,
    execution_changes,
)
from uniweave.train.engine.retention import Retention
from uniweave.train.state import checkpoint as ckpt
from uniweave.train.state import sharded
from uniweave.train.state.fingerprints import FINGERPRINTS, input_fingerprints
from uniweave.train.state.parent import parent_checkpoint, parent_record


class Checkpointer:
    def __init__(
        self,
        cfg: UniweaveConfig,
        run_dir: Path,
        dist: DistInfo,
        model: UnifiedModel,
        parallel: Parallel,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        objective: Objective,
        trainable_state: Callable[[], dict[str, torch.Tensor]] | None,
        keys: set[str],
        retention: Retention,
    ) -> None:
        """`trainable_state` (None: the whole model's `state_dict`) is what a
        single-process checkpoint stores of the model, `keys` its names (taken before the
        model was wrapped for ddp/fsdp2)."""
        self.cfg = cfg
        self.run_dir = run_dir
        self.dist = dist
        self.model = model
        self.parallel = parallel
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.objective = objective
        self.partial = trainable_state is not None
        self.trainable_state = trainable_state or self._full_state
        self.keys = keys
        self.retention = retention
        self.identity = objective.identity
        self.config_hash = config_hash(cfg)
        self.resumed_from: Path | None = None
        self.parent: dict[str, str] | None = None  # the run.parent checkpoint started from
        self.from_parent = False  # this start loaded the parent (not an own checkpoint)
        self._fingerprints: dict | None = None
        # world-size and execution-only config changes met on resume (checkpoint record)
        self.execution_changes: list[dict[str, Any]] = []
        self.last_saved = time.monotonic()

    def _full_state(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def save(self, update: int, named_params: dict[str, nn.Parameter]) -> None:
        """Checkpoint `update`: every rank writes its RNG state (and under ddp/fsdp2 its DCP
        shards) into the staging directory, then rank 0 commits it (DDP: after the
        replicas' parameters `named_params` were found identical)."""
        staging = ckpt.staging_dir(self.run_dir, update)
        self.parallel.check_replicas(named_params, "parameter")
        barrier(self.dist)
        ckpt.write_rank_rng(staging, self.dist.rank)
        state = {
            "config_hash": self.config_hash,
            "config": self.cfg.model_dump(mode="json"),
            "data_cursor": update,
            "world_size": self.dist.world_size,
            "execution_changes": self.execution_changes,
            "optimizer_saved": bool(self.optimizer.state) or not self.parallel.distributed,
            **({"identity": self.identity} if self.identity is not None else {}),
            **({"parent": self.parent} if self.parent is not None else {}),
            **self.retention.state(),
        }
        if self.dist.is_main:
            if self._fingerprints is None:  # what the run reads, fingerprinted once
                self._fingerprints = input_fingerprints(self.cfg)
            state[FINGERPRINTS] = self._fingerprints
        if self.parallel.distributed:
            sharded.save_sharded(
                staging, self.model, self.optimizer, self.scheduler, self.keys, self.dist
            )
        barrier(self.dist)
        if self.dist.is_main:
            inject_fault("checkpoint_write", update)
            keep = self.cfg.checkpoint.keep_last
            if self.parallel.distributed:
                ckpt.seal_checkpoint(self.run_dir, update, state, keep)
            else:
                opt = {
                    "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(),
                }
                objective_state = self.objective.state_dict()
                if objective_state is not None:  # an objective's own state (an EMA shadow)
                    opt["objective"] = objective_state
                model_state = self.trainable_state()
                ckpt.commit_checkpoint(self.run_dir, update, model_state, opt, state, keep)
        barrier(self.dist)
        self.last_saved = time.monotonic()

    def resume(self) -> int | None:
        """Load the latest intact checkpoint of the run directory, else (with `run.parent`)
        the parent checkpoint; return its update, None when there is none. Says which on
        stdout."""
        scan = ckpt.scan_checkpoints(self.run_dir)
        found = scan.latest
        parent = self.cfg.run.parent
        if found is None and parent is not None:
            found = parent_checkpoint(self.cfg)
            self.from_parent = True
        if found is not None:
            check_identity(found, self.identity)
            check_resume(found, self.cfg)
            check_world_size_change(found, self.dist.world_size, self.model)
        barrier(self.dist)
        if self.dist.is_main:
            ckpt.tidy_run_dir(self.run_dir, scan)
        barrier(self.dist)
        if found is None:
            return None
        self.parent = parent_record(found) if self.from_parent else found.state.get("parent")
        if self.dist.is_main and parent is not None:
            if self.from_parent:
                status(f"starting from the parent checkpoint {found.path} (run.parent)")
            else:
                status(
                    f"resuming from this run's own checkpoint {found.path} (not the "
                    f"run.parent {parent})"
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
                self.keys,
                self.dist,
                with_optim=found.state.get("optimizer_saved", True),
            )
        else:
            self._load_single(found)
        saved_world = found.state.get("world_size")
        rank = self.dist.rank if saved_world in (None, self.dist.world_size) else 0
        if (found.path / f"rng-rank{rank}.pt").is_file():
            ckpt.restore_rng_states(found.rng_state(rank))
        self.resumed_from = found.path
        self.execution_changes = execution_changes(
            found, self.cfg, self.dist.world_size, self.from_parent, say=self.dist.is_main
        )
        if self.from_parent:  # a child starts without metrics, best record or rollouts
            return found.update
        self.retention.resume(found)
        if self.dist.is_main:
            truncate_metrics(self.run_dir / "metrics.jsonl", found.update)
            truncate_tensorboard(self.run_dir, found.update)
            self.retention.resume_files(found)
        return found.update

    def _load_single(self, found: ckpt.Checkpoint) -> None:
        missing, unexpected = self.model.load_state_dict(found.model_state(), strict=False)
        if unexpected or (missing and not self.partial):
            raise TrainingError(
                f"{found.path}: checkpoint does not fit the model "
                f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
            )
        opt = found.optimizer_state()
        self.optimizer.load_state_dict(opt["optimizer"])
        self.scheduler.load_state_dict(opt["scheduler"])
        if not self.from_parent:  # a child run starts its objective state afresh
            self.objective.load_state_dict(opt.get("objective"))
