"""Per-rank parameter + optimizer-state memory under `trainer.parallel: fsdp2` vs `ddp`
(2 gloo processes on CPU); the acceptance bar is fsdp2 <= 0.6x ddp.

Each mode runs one real SFT update (AdamW, so the optimizer holds exp_avg and
exp_avg_sq for every trainable element) on a tiny uniweave model of `--layers` decoder
layers of width `--hidden`, then every rank counts the bytes it holds: the local storage
of each parameter (a DTensor's local shard under fsdp2, the full replica under ddp) and
of each optimizer-state tensor. Gradients are excluded (freed by zero_grad). The counts
are of the tensors the rank keeps resident between updates, not an allocator's view.

    PYTHONPATH=src .venv/bin/python bench/parallel_memory.py [--hidden 256] [--layers 4]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

from uniweave.config import validate_config
from uniweave.models.build import build_model
from uniweave.train.distributed.comm import init_distributed, shutdown_distributed
from uniweave.train.engine.trainer import Trainer
from uniweave.train.run import JOBS, _prepare_model

BAR = 0.6


def local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def config(root: Path, mode: str, hidden: int, layers: int, fit: bool = False):
    """The bench's SFT config (`fit`: no codec path, so `build_model` fits one)."""
    codec = {"codebook_size": 16} if fit else {"path": str(root / "codec"), "codebook_size": 16}
    return validate_config(
        {
            "run": {"name": "mem", "seed": 0, "output_dir": str(root / mode), "device": "cpu"},
            "model": {
                "tiny": {
                    "hidden_size": hidden,
                    "num_layers": layers,
                    "num_heads": 4,
                    "intermediate_size": 4 * hidden,
                },
                "codec": codec,
            },
            "data": {"tasks": ["t2i", "i2t_mc"], "train_size": 4, "val_size": 0, "test_size": 0},
            "trainer": {
                "total_updates": 1,
                "global_batch_size": 4,
                "micro_batch_size": 2,
                "parallel": mode,
                "fsdp": {"param_dtype": "fp32"},
            },
            "checkpoint": {"every_updates": 0},
            "logging": {"tensorboard": False, "progress_bar": False},
        }
    )


def worker(rank: int, root: str, mode: str, hidden: int, layers: int, port: int, out) -> None:
    os.environ.update(
        {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"}
        | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    )
    torch.set_num_threads(1)
    cfg = config(Path(root), mode, hidden, layers)
    info, device = init_distributed(torch.device("cpu"), mode, 600.0)
    try:
        model = _prepare_model(cfg, Path(root) / mode, device)
        source, objective = JOBS["sft"](cfg, model, Path(root) / mode, info)
        trainer = Trainer(
            model, source, objective, cfg, Path(root) / mode, info, model.special_ids.pad
        )
        trainer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        params = sum(local_bytes(p) for p in model.parameters())
        optim = sum(
            local_bytes(v)
            for state in trainer.optimizer.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        )
        out.put((mode, rank, params, optim))
    finally:
        shutdown_distributed()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build_model(config(root, "ddp", args.hidden, args.layers, True), codec_dir=root / "codec")
        results = {}
        for mode in ("ddp", "fsdp2"):
            queue = ctx.Queue()
            port = free_port()
            procs = [
                ctx.Process(
                    target=worker, args=(r, tmp, mode, args.hidden, args.layers, port, queue)
                )
                for r in range(2)
            ]
            for p in procs:
                p.start()
            rows = [queue.get(timeout=600) for _ in procs]
            for p in procs:
                p.join()
                if p.exitcode != 0:
                    print(f"{mode}: a rank failed (exit {p.exitcode})", file=sys.stderr)
                    return 1
            for _, rank, params, optim in sorted(rows, key=lambda r: r[1]):
                print(
                    f"{mode:5s} rank {rank}: parameters {params / 2**20:8.3f} MiB  "
                    f"optimizer {optim / 2**20:8.3f} MiB  total {(params + optim) / 2**20:8.3f} MiB"
                )
            results[mode] = max(params + optim for _, _, params, optim in rows)
    ratio = results["fsdp2"] / results["ddp"]
    verdict = "PASS" if ratio <= BAR else "FAIL"
    print(
        f"fsdp2 / ddp per-rank (largest rank) parameter + optimizer memory: {ratio:.3f} "
        f"(bar <= {BAR}): {verdict}"
    )
    return 0 if ratio <= BAR else 1


if __name__ == "__main__":
    sys.exit(main())
