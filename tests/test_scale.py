"""Scale-out (docs/architecture.md §5), 2 gloo processes on CPU, fp32:

- `trainer.gradient_sync`: plain DDP buckets (`ddp`, the default: each rank's gradient
  divided by W = 2, all-reduced, multiplied by 2) and the SUM comm hook
  (`post_backward_sum`) give bitwise-equal models. Why bitwise and not a rounding bound:
  dividing and multiplying by a power of two is exact in binary floating point (barring
  subnormals), and 0.5 * a + 0.5 * b rounds to exactly half of the rounded a + b, so both
  paths produce the same bits (uniweave.train.distributed.parallel's docstring; other W would
  differ by ~(W + 1) ulp).
- `trainer.world_size: 2` (`uniweave train` spawns its workers) equals `torchrun
  --nproc-per-node 2` bitwise: each worker runs the same code path with the same
  environment.
- refusals: world_size > 1 under torchrun, world_size > 1 with parallel none.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from trainer_helpers import run_cli, tiny_config, write_config

from uniweave.config import ConfigError, validate_config

TORCHRUN = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node=2"]


def sft(run_dir: Path, codec_dir: Path, **trainer) -> dict:
    """2 updates of SFT, 2 micro-batches per rank (no_sync acts), parallel ddp."""
    base = {"total_updates": 2, "micro_batch_size": 2, "parallel": "ddp", **trainer}
    return tiny_config(run_dir, codec_dir, trainer=base, checkpoint={"every_updates": 0})


def model(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "model" / "model.safetensors"))


def test_gradient_sync_modes_and_spawned_workers_equal_torchrun(tmp_path, small_vq_dir):
    runs = {
        "torchrun-ddp": ({}, TORCHRUN),
        "torchrun-sum": ({"gradient_sync": "post_backward_sum"}, TORCHRUN),
        "spawned-ddp": ({"world_size": 2}, None),
    }
    for name, (trainer, launcher) in runs.items():
        path = write_config(
            tmp_path / f"{name}.yaml", sft(tmp_path / name, small_vq_dir, **trainer)
        )
        launcher = None if launcher is None else [*launcher, "-m", "uniweave.cli"]
        proc = run_cli(["train", str(path)], launcher=launcher)
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
    ref = model(tmp_path / "torchrun-ddp")
    for name in ("torchrun-sum", "spawned-ddp"):
        got = model(tmp_path / name)
        assert got.keys() == ref.keys()
        for key, value in ref.items():
            assert torch.equal(value, got[key]), (name, key)


def test_world_size_refusals(tmp_path, small_vq_dir):
    cfg = sft(tmp_path / "r", small_vq_dir, world_size=2, parallel="none")
    with pytest.raises(ConfigError, match="trainer.world_size.*need trainer.parallel ddp"):
        validate_config(cfg)
    path = write_config(tmp_path / "r.yaml", sft(tmp_path / "r", small_vq_dir, world_size=2))
    # what torchrun puts in each worker's environment
    torchrun_env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    proc = run_cli(["train", str(path)], env_extra=torchrun_env)
    assert proc.returncode == 2
    assert "trainer.world_size=2 under torchrun" in proc.stderr
    assert not (tmp_path / "r").exists()
