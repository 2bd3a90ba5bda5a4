"""Shared set-up for the trainer tests (not collected: no test_ prefix): tiny SFT and GRPO
configs on a pre-fitted codec, `uniweave` subprocesses, checkpoint comparisons, and the
LoRA-only update check of the UniAR training tests."""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import yaml
from safetensors.torch import load_file

from uniweave.codecs import build_codec
from uniweave.data.digits_images import load_split

if TYPE_CHECKING:
    from uniweave.config import UniweaveConfig
    from uniweave.train.engine.trainer import Trainer

TASKS = ["t2i", "i2t_mc", "jigsaw_mc", "draw_then_answer"]


def fit_small_codec(path: Path, kind: str = "vq") -> Path:
    images = load_split("train").images[:300]
    if kind == "vq":
        codec = build_codec("vq", codebook_size=16, n_init=1, max_iter=20)
    else:
        codec = build_codec("bsq", latent_dim=8, hidden=32, epochs=2)
    codec.fit(images, seed=0).save_pretrained(path)
    return path


def tiny_config(run_dir: Path, codec_dir: Path, **sections) -> dict:
    """A dict config: 2-layer width-32 model, 8 rows per task, fast checkpoints."""
    cfg = {
        "run": {"name": "t", "seed": 3, "output_dir": str(run_dir), "device": "cpu"},
        "model": {
            "kind": "tiny",
            "visual_head": "vq",
            "tiny": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64},
            "codec": {"path": str(codec_dir), "codebook_size": 16},
        },
        "data": {"tasks": TASKS, "train_size": 8, "val_size": 0, "test_size": 0},
        "trainer": {
            "optimizer": {"lr": 3e-3},
            "total_updates": 8,
            "global_batch_size": 8,
            "micro_batch_size": 4,
        },
        "checkpoint": {"every_updates": 2, "keep_last": 0},
        "logging": {"tensorboard": False, "progress_bar": False},
    }
    for section, values in sections.items():
        cfg[section] = {**cfg.get(section, {}), **values}
    return cfg


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


class ForkedCLI:
    """`python -m uniweave ARGS` without paying Python's and torch's start-up per call.

    A forkserver process imports `uniweave.cli` (and torch) once, without running any torch
    kernel (so no OpenMP pool exists to be copied across a fork); each call forks a child
    of it that changes into `cwd`, points file descriptors 1 and 2 at its own files, sets
    `env` and runs `uniweave.cli.main(args)` exactly as `python -m uniweave` does, then
    `os._exit`s with its return code. Each call is a separate process (its own exit code,
    stderr, signals and cwd) like `subprocess.run`; only the import time is shared.
    """

    def __init__(self) -> None:
        import multiprocessing

        self.ctx = multiprocessing.get_context("forkserver")
        self.ctx.set_forkserver_preload(["torch", "uniweave.cli", "uniweave.train.run"])

    def run(self, args: list[str], cwd: Path, env: dict[str, str], timeout: float = 600):
        scratch = Path(tempfile.mkdtemp(prefix="uniweave-cli-"))
        out, err = scratch / "stdout", scratch / "stderr"
        child = self.ctx.Process(target=_cli_child, args=(args, str(cwd), env, str(out), str(err)))
        child.start()
        child.join(timeout)
        if child.is_alive():
            child.kill()
            child.join()
            raise subprocess.TimeoutExpired(["uniweave", *args], timeout)
        # the child's own record of its code: the forkserver reports 255 for a child it
        # could not reap itself (seen twice in 7 runs of tests/test_bad_inputs.py, 98 calls each)
        code_file = scratch / "code"
        code = int(code_file.read_text()) if code_file.is_file() else child.exitcode
        result = subprocess.CompletedProcess(
            ["uniweave", *args], code, out.read_text(), err.read_text()
        )
        shutil.rmtree(scratch)
        return result


def _cli_child(args: list[str], cwd: str, env: dict[str, str], out: str, err: str) -> None:
    import traceback

    os.chdir(cwd)
    # a fresh `python -m uniweave` turns SIGINT into KeyboardInterrupt; a forkserver child
    # inherits whatever disposition its server was started with (a full CI run once had
    # SIGINT ignored there: the Ctrl-C test's run finished with exit 0 instead of 130)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = ["uniweave", *args]
    from uniweave.cli import main

    try:
        code = main(args)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    Path(out).with_name("code").write_text(f"{code}\n")
    os._exit(code)


def run_cli(args: list[str], env_extra: dict | None = None, launcher: list[str] | None = None):
    env = {**os.environ, "CI": "true", "OMP_NUM_THREADS": "1", **(env_extra or {})}
    cmd = launcher or [sys.executable, "-m", "uniweave.cli"]
    return subprocess.run(cmd + args, capture_output=True, text=True, env=env, timeout=600)


def checkpoint_tensors(ckpt: Path) -> tuple[dict, dict]:
    """(model tensors, optimizer + scheduler state) of a checkpoint, one-process or
    torch.distributed.checkpoint (``dcp/``, trainer.parallel ddp/fsdp2)."""
    if (ckpt / "dcp").is_dir():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        out = ckpt.parent.parent / f"{ckpt.name}-dcp.pt"
        dcp_to_torch_save(ckpt / "dcp", out)
        state = torch.load(out, weights_only=False)
        out.unlink()
        return state.pop("model"), state
    model = load_file(str(ckpt / "model.safetensors"))
    opt = torch.load(ckpt / "optimizer.pt", weights_only=False)
    return model, opt


def assert_same_state(a: object, b: object, where: str = "") -> None:
    """Bitwise equality of nested dicts/lists of tensors and plain values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            assert_same_state(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def opd_config(run_dir: Path, assets: dict, kind: str = "vq", seed: int = 3, **algo) -> dict:
    """A tiny OPD config: 6 prompts (t2i + i2t_mc) per update, the kit's teacher."""
    cfg = tiny_config(
        run_dir,
        assets[kind],
        model={"visual_head": kind, "codec": {"path": str(assets[kind]), "codebook_size": 16}},
        data={"tasks": ["t2i", "i2t_mc"], "train_size": 16},
        rollout={"max_new_tokens": 20, "length_semantics": "cap"},
        reward={
            "plugins": [
                {"name": "digit_classifier", "path": str(assets["clf"]), "tasks": ["t2i"]},
                {"name": "mc_exact", "tasks": ["i2t_mc"]},
            ],
            "truncated_reward": "keep",
        },
        trainer={"total_updates": 2, "global_batch_size": 6, "micro_batch_size": 3},
    )
    cfg["run"]["seed"] = seed
    teacher = str(assets.get(f"teacher_{kind}", "/nonexistent"))
    cfg["algorithm"] = {"name": "opd", "teacher": {"path": teacher}, **algo}
    return cfg


def grpo_config(run_dir: Path, assets: dict, kind: str = "vq", task: str = "t2i", **sections):
    """A tiny GRPO config: 2 prompts x G=4 per update, exact-count images for t2i.
    `assets`: the codec directory under "vq"/"bsq" and the classifier directory "clf"."""
    plugins = {
        "t2i": [{"name": "digit_classifier", "path": str(assets["clf"])}],
        "i2t_mc": [{"name": "mc_exact"}],
    }[task]
    base = tiny_config(
        run_dir,
        assets[kind],
        model={"visual_head": kind, "codec": {"path": str(assets[kind]), "codebook_size": 16}},
        data={"tasks": [task], "train_size": 16, "val_size": 0, "test_size": 0},
        rollout={
            "max_new_tokens": 16 if task == "t2i" else 3,
            "length_semantics": "exact" if task == "t2i" else "cap",
        },
        reward={"plugins": plugins},
        algorithm={"name": "grpo", "group_size": 4, "kl": {"type": "k3", "coef": 0.05}},
        trainer={"total_updates": 2, "global_batch_size": 8, "micro_batch_size": 4},
    )
    for section, values in sections.items():
        base[section] = {**base.get(section, {}), **values}
    return base


LORA_REGEX = (
    r"model\.language_model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
)
"""The UniAR recipes' LoRA targets: the language model's attention and MLP projections."""


def one_update_changes_only_lora(trainer: Trainer) -> dict[str, float]:
    """Run `trainer`'s single update; assert it changed LoRA tensors of the language model
    (`model.language_model.*`) and nothing else, with a finite loss. Its metrics."""
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    (metrics,) = [m for _, m in trainer.fit()]
    after = trainer.model.state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed and all(".lora_" in k and k.startswith("model.language_model.") for k in changed)
    assert math.isfinite(metrics["loss"])
    return metrics


def make_grpo_trainer(cfg: dict | UniweaveConfig) -> Trainer:
    """What `uniweave train` builds for a GRPO config (without its run-directory files)."""
    from uniweave.config import UniweaveConfig, validate_config
    from uniweave.data.tokenizer import SpecialIds
    from uniweave.models.build import build_model
    from uniweave.train.distributed.comm import DistInfo
    from uniweave.train.engine.lora import adapter_state, apply_lora
    from uniweave.train.engine.trainer import Trainer
    from uniweave.train.methods.grpo.job import build_grpo_job

    cfg = cfg if isinstance(cfg, UniweaveConfig) else validate_config(cfg)
    run_dir = Path(cfg.run.output_dir)
    model = build_model(cfg)
    lora = cfg.trainer.lora.enabled
    if lora:
        apply_lora(model, cfg)
    model.train()
    source, objective = build_grpo_job(cfg, model, run_dir, DistInfo())
    pad = SpecialIds.from_tokenizer(model.tokenizer).pad
    state = (lambda: adapter_state(model)) if lora else None
    return Trainer(model, source, objective, cfg, run_dir, DistInfo(), pad, state)


def fit_metrics(trainer: Trainer) -> list[dict]:
    """The metrics of every update of `trainer.fit()`."""
    return [metrics for _, metrics in trainer.fit()]
