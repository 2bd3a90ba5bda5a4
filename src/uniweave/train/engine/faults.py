"""Test hooks that kill or desynchronise a process at a named point, driven by environment
variables (the kill-and-resume and replica-drift tests set them; unset, they do nothing)."""

from __future__ import annotations

import os
import signal

import torch

from uniweave.models.base import UnifiedModel

FAULT_ENV = "UNIWEAVE_FAULT"
FAULT_RANK_ENV = "UNIWEAVE_FAULT_RANK"
PERTURB_ENV = "UNIWEAVE_PERTURB"


def perturb_for_test(model: UnifiedModel, rank: int) -> None:
    """Test hook: `UNIWEAVE_PERTURB=<rank>:<parameter name>` adds 1e-3 to that parameter on
    that rank (a desynchronised replica for the drift check)."""
    spec = os.environ.get(PERTURB_ENV, "")
    if spec and spec.split(":", 1)[0] == str(rank):
        with torch.no_grad():
            model.get_parameter(spec.split(":", 1)[1]).add_(1e-3)


def inject_fault(point: str, update: int) -> None:
    """Test hook: `UNIWEAVE_FAULT=<point>:<update>` SIGKILLs this process at that point
    (points: rollout, update (after a micro-batch's backward), after_update,
    checkpoint_write, model_write); `UNIWEAVE_FAULT=<point>:<update>:SIGINT` sends SIGINT
    instead (a Ctrl-C: Python raises KeyboardInterrupt there). With `UNIWEAVE_FAULT_RANK=<r>`
    only the process of that rank (torchrun's `RANK`, 0 without torchrun) is hit: one
    worker of a job dies while the others carry on until the launcher stops them."""
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return
    only = os.environ.get(FAULT_RANK_ENV)
    if only is not None and only != os.environ.get("RANK", "0"):
        return
    where, _, sig = spec.partition(":SIG")
    if where == f"{point}:{update}":
        os.kill(os.getpid(), signal.SIGINT if sig == "INT" else signal.SIGKILL)
