"""Checkpoints under `trainer.parallel: ddp | fsdp2` (torch.distributed.checkpoint).

Every rank writes its shards of the model and optimizer state (and the scheduler's,
stored once) into ``<staging>/dcp/`` with `torch.distributed.checkpoint.save`; rank 0
then seals the staging directory (`checkpoint.seal_checkpoint`: manifest, fsync,
rename) after a barrier, so a checkpoint is complete or absent exactly as in one
process. DDP replicas are deduplicated by DCP's planner (written once). Loading reads the
shards this rank needs whatever the world size that wrote them (DCP reshards: a 2-rank
checkpoint resumes at 1 or 3 ranks with the same values, tests/test_reshard.py).

The model state is keyed by the parameter names of the unwrapped model (FSDP2 keeps them)
and restricted to `keys` (the LoRA adapters alone when LoRA is on). An optimizer with no
state yet (the checkpoint before the first update) is not saved: asking torch for its
state dict would initialise it with a zero-gradient step.

`full_model_state` gathers the whole model on rank 0 (CPU) for the final `model/` export.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from uniweave.train.distributed.comm import DistInfo
from uniweave.train.state.checkpoint import DCP

PARTIAL = StateDictOptions(strict=False)


def _states(
    model: nn.Module, optimizer: torch.optim.Optimizer, keys: Collection[str], with_optim: bool
) -> dict[str, Any]:
    if with_optim:
        msd, osd = get_state_dict(model, optimizer)
    else:
        msd, osd = get_model_state_dict(model), None
    out: dict[str, Any] = {"model": {k: v for k, v in msd.items() if k in keys}}
    if osd is not None:
        out["optim"] = osd
    return out


def save_sharded(
    staging: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    keys: Collection[str],
    info: DistInfo,
) -> None:
    """Write this rank's shards into ``staging/dcp`` (a collective: every rank calls it)."""
    state = _states(model, optimizer, keys, with_optim=bool(optimizer.state))
    state["scheduler"] = scheduler.state_dict()
    dcp.save(state, checkpoint_id=str(Path(staging) / DCP), process_group=info.cpu_group)


def load_sharded(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    keys: Collection[str],
    info: DistInfo,
    with_optim: bool,
) -> None:
    """Load checkpoint `path` (written by `save_sharded`) into the live model, optimizer
    and scheduler (a collective)."""
    state = _states(model, optimizer, keys, with_optim)
    state["scheduler"] = scheduler.state_dict()
    dcp.load(state, checkpoint_id=str(Path(path) / DCP), process_group=info.cpu_group)
    if with_optim:
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=PARTIAL,
        )
    else:
        set_model_state_dict(model, state["model"], options=PARTIAL)
    scheduler.load_state_dict(state["scheduler"])


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole (unsharded) model state on rank 0, on CPU; empty on other ranks
    (a collective)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return cast(dict[str, torch.Tensor], get_model_state_dict(model, options=options))
