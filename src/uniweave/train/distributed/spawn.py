"""`trainer.world_size: N` — `uniweave train` starts its own N local worker processes.

The launching process (not itself a worker) picks a free local port, and
`torch.multiprocessing.start_processes` (start method `spawn`: fresh interpreters, as
torchrun's) runs `uniweave.cli.main(argv)` in N children, each with the environment torchrun
would give it (RANK = LOCAL_RANK = i, WORLD_SIZE = LOCAL_WORLD_SIZE = N, MASTER_ADDR,
MASTER_PORT, and OMP_NUM_THREADS=1 unless set, torchrun's default). Each child then runs
exactly the torchrun path (`init_distributed` with `env://`), so a run with
`trainer.world_size: 2` equals `torchrun --standalone --nproc-per-node 2 -m uniweave.cli train`
bitwise. `UNIWEAVE_SPAWNED=1` marks the children, which therefore do not spawn again.

Refused: world_size > 1 under torchrun (torchrun already made the processes; drop one of
the two), world_size > 1 with `trainer.parallel: none` (config time), and on CUDA more
workers than visible devices. Several nodes: torchrun (docs/architecture.md §5).
"""

from __future__ import annotations

import importlib
import os
import socket
import sys
from collections.abc import Sequence

import torch

from uniweave.config import ConfigError

SPAWNED = "UNIWEAVE_SPAWNED"


def is_spawned_worker() -> bool:
    return os.environ.get(SPAWNED) == "1"


def check_world_size(world_size: int, device: str) -> None:
    """Run-time refusals (those that depend on the environment, not the config)."""
    if world_size <= 1:
        return
    if not is_spawned_worker() and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        raise ConfigError(
            f"trainer.world_size={world_size} under torchrun: torchrun already started "
            f"WORLD_SIZE={os.environ['WORLD_SIZE']} processes; remove trainer.world_size or "
            "run without torchrun",
            key="trainer.world_size",
        )
    if device.startswith("cuda") and torch.cuda.device_count() < world_size:
        raise ConfigError(
            f"trainer.world_size={world_size} but only {torch.cuda.device_count()} CUDA "
            "devices are visible (one worker per device)",
            key="trainer.world_size",
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, entry: str, argv: list[str]) -> None:
    os.environ.update(
        {
            SPAWNED: "1",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "GROUP_RANK": "0",
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    module, name = entry.split(":")
    code = getattr(importlib.import_module(module), name)(argv)
    if code:
        raise SystemExit(code)
    # A rank that finished leaves without interpreter finalization. The run has closed
    # its files and destroyed its process groups (run_train's finally), but gloo's C++
    # threads can still be joinable when finalization destroys them, and that aborts the
    # finished rank (SIGABRT, "terminate called without an active exception" after
    # "uniweave train: done"; seen twice in about ten CI runs, in test_opd_parallel and
    # test_distributed_eval). _exit skips only atexit handlers and C++ static
    # destructors; uniweave registers no atexit handler.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_workers(world_size: int, entry: str, argv: Sequence[str]) -> int:
    """Run `entry(argv)` (`module:function`, the CLI's `uniweave.cli:main`, named rather than
    imported: the CLI sits above this layer) in `world_size` local workers; 0 when all of
    them succeed (otherwise start_processes raises with the failing worker's error)."""
    import torch.multiprocessing as mp

    saved = os.environ.get("OMP_NUM_THREADS")
    if saved is None:
        os.environ["OMP_NUM_THREADS"] = "1"  # torchrun's default for several processes
    try:
        mp.start_processes(
            _worker,
            args=(world_size, _free_port(), entry, list(argv)),
            nprocs=world_size,
            join=True,
            start_method="spawn",
        )
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
    return 0
