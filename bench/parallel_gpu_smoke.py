"""Smoke test of `trainer.parallel` on real devices (not part of CI), run under torchrun.

A few SFT updates of a tiny random model (`--model tiny`: the embedded model; `janus`: a
tiny random Janus-Pro) under `--mode none | ddp | fsdp2` (bf16 parameters under fsdp2 on
GPU, fp32 on CPU), then one checkpoint (under ddp the replica-drift check runs before
it: hashes of every trainable parameter, and of the gradients after the first backward).
Each rank prints its device, median step time and peak memory (CUDA: max allocated /
reserved; CPU: the process's resident high-water mark).

    torchrun --standalone --nproc-per-node=8 bench/parallel_gpu_smoke.py --mode fsdp2
    bench/parallel_gpu_smoke.sh 8       # every mode x model on 8 GPUs (1: none too)
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch

from uniweave.config import validate_config
from uniweave.data.digits import vocabulary_texts
from uniweave.models.build import build_model, resolve_device
from uniweave.models.janus_pro.tiny import TinyJanusSpec, write_tiny_checkpoint
from uniweave.train.distributed.comm import barrier, init_distributed, shutdown_distributed
from uniweave.train.engine.trainer import Trainer
from uniweave.train.run import JOBS, _prepare_model


def config(root: Path, mode: str, model: str, device: str, updates: int, fit: bool = False):
    cuda = device.startswith("cuda")
    if model == "janus":
        model_cfg = {"kind": "janus_pro", "path": str(root / "janus")}
    else:
        codec = {"codebook_size": 16} if fit else {"path": str(root / "codec"), "codebook_size": 16}
        model_cfg = {"tiny": {"hidden_size": 256, "num_layers": 4, "num_heads": 4}, "codec": codec}
    return validate_config(
        {
            "run": {"name": "smoke", "seed": 0, "output_dir": str(root / "run"), "device": device},
            "model": model_cfg,
            "data": {"tasks": ["t2i", "i2t_mc"], "train_size": 16, "val_size": 0, "test_size": 0},
            "trainer": {
                "total_updates": updates,
                "global_batch_size": 16,
                "micro_batch_size": 4,
                "parallel": mode,
                "precision": "bf16" if cuda else "fp32",
                # fsdp settings are refused under another parallel mode (they would not act)
                **(
                    {"fsdp": {"param_dtype": "bf16" if cuda else "fp32"}} if mode == "fsdp2" else {}
                ),
            },
            "checkpoint": {"every_updates": 0},
            "logging": {"tensorboard": False, "progress_bar": False},
        }
    )


def peak_memory(device: torch.device) -> str:
    if device.type == "cuda":
        alloc = torch.cuda.max_memory_allocated(device) / 2**20
        reserved = torch.cuda.max_memory_reserved(device) / 2**20
        return f"peak allocated {alloc:.1f} MiB, reserved {reserved:.1f} MiB"
    return f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.1f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["none", "ddp", "fsdp2"], default="fsdp2")
    parser.add_argument("--model", choices=["tiny", "janus"], default="tiny")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--root", default=None, help="shared scratch directory (default: /tmp)")
    args = parser.parse_args()
    device = resolve_device(args.device)
    info, device = init_distributed(device, args.mode, 600.0)
    root = Path(args.root or tempfile.gettempdir()) / f"uniweave-smoke-{args.mode}-{args.model}"
    try:
        if info.is_main:  # shared assets, made once
            if args.model == "janus":
                write_tiny_checkpoint(root / "janus", TinyJanusSpec(grid=2), vocabulary_texts())
            else:
                fit = config(root, args.mode, args.model, str(device), args.updates, fit=True)
                build_model(fit, codec_dir=root / "codec")
        barrier(info)
        cfg = config(root, args.mode, args.model, str(device), args.updates)
        run_dir = root / "run"
        model = _prepare_model(cfg, run_dir, device)
        source, objective = JOBS["sft"](cfg, model, run_dir, info)
        trainer = Trainer(model, source, objective, cfg, run_dir, info, model.special_ids.pad)
        seconds = []
        for _ in range(args.updates):
            t0 = time.perf_counter()
            metrics = trainer.step()
            trainer.update += 1
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - t0)
        if info.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
        barrier(info)
        trainer.save()
        drift = " (DDP replicas hash-identical)" if args.mode == "ddp" else ""
        print(
            f"[{args.mode} {args.model}] rank {info.rank}/{info.world_size} on {device}: "
            f"loss {metrics['loss']:.4f}, step {statistics.median(seconds):.3f} s (median of "
            f"{len(seconds)}), {peak_memory(device)}; checkpoint written{drift}",
            flush=True,
        )
        if device.type == "cuda":
            peaks = (
                torch.cuda.max_memory_allocated(device),
                torch.cuda.max_memory_reserved(device),
            )
            mem = " | ".join(f"{b / 2.0**30:.2f}" for b in peaks)
        else:
            mem = "- | -"
        t = cfg.trainer
        print(
            f"RESULT | parallel {args.mode} {args.model} rank{info.rank} | "
            f"{type(model).__name__} {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
            f"params | {t.global_batch_size} rows mb{t.micro_batch_size} world"
            f"{info.world_size} {t.precision} | {statistics.median(seconds):.3f} | - | - | "
            f"{statistics.median(seconds):.3f} | {mem} |",
            flush=True,
        )
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    main()
