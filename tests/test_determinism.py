"""`run.deterministic` (default on): the same command gives the same bits at a fixed thread
count, also across a SIGKILL and a resume, for SFT and GRPO. The runs are real `uniweave
train` subprocesses at two intra-op threads (OMP_NUM_THREADS=2), where the
non-deterministic kernels used to make two identical runs differ at ~1e-7."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file
from trainer_helpers import (
    assert_same_state,
    checkpoint_tensors,
    run_cli,
    tiny_config,
    write_config,
)

TWO_THREADS = {"OMP_NUM_THREADS": "2"}


@pytest.fixture(scope="module")
def assets(small_vq_dir, classifier_dir):
    return {"vq": small_vq_dir, "clf": classifier_dir}


def sft(run_dir: Path, assets: dict) -> dict:
    return tiny_config(
        run_dir,
        assets["vq"],
        trainer={"total_updates": 6, "global_batch_size": 8, "micro_batch_size": 4},
        checkpoint={"every_updates": 2, "keep_last": 0},
    )


def grpo(run_dir: Path, assets: dict) -> dict:
    return tiny_config(
        run_dir,
        assets["vq"],
        data={"tasks": ["t2i"], "train_size": 8},
        rollout={"max_new_tokens": 16, "length_semantics": "exact"},
        reward={"plugins": [{"name": "digit_classifier", "path": str(assets["clf"])}]},
        algorithm={"name": "grpo", "group_size": 4, "kl": {"type": "k3", "coef": 0.05}},
        trainer={"total_updates": 4, "global_batch_size": 8, "micro_batch_size": 4},
        checkpoint={"every_updates": 2, "keep_last": 0},
    )


def train(cfg: dict, path: Path, fault: str | None = None) -> int:
    env = {**TWO_THREADS, **({"UNIWEAVE_FAULT": fault} if fault else {})}
    done = run_cli(["train", str(write_config(path, cfg))], env_extra=env)
    assert done.returncode == (-9 if fault else 0), done.stderr[-2000:]
    return done.returncode


def final(run_dir: Path) -> dict:
    return load_file(str(run_dir / "model" / "model.safetensors"))


def test_two_identical_sft_runs_at_two_threads_are_bitwise_equal(tmp_path, assets):
    for name in ("a", "b"):
        train(sft(tmp_path / name, assets), tmp_path / f"{name}.yaml")
    assert_same_state(final(tmp_path / "a"), final(tmp_path / "b"), "model")
    moved = load_file(str(tmp_path / "a" / "checkpoints" / "update-000000" / "model.safetensors"))
    assert any((moved[k] != v).any() for k, v in final(tmp_path / "a").items())


@pytest.mark.parametrize(
    ("job", "fault"), [("sft", "after_update:3"), ("grpo", "rollout:3")], ids=["sft", "grpo"]
)
def test_sigkill_and_resume_at_two_threads_is_bitwise_equal(tmp_path, assets, job, fault):
    make = {"sft": sft, "grpo": grpo}[job]
    train(make(tmp_path / "ref", assets), tmp_path / "ref.yaml")
    cut = make(tmp_path / "cut", assets)
    train(cut, tmp_path / "cut.yaml", fault)
    train(cut, tmp_path / "cut.yaml")
    assert_same_state(final(tmp_path / "ref"), final(tmp_path / "cut"), "model")
    last = f"update-{cut['trainer']['total_updates']:06d}"
    ref_state = checkpoint_tensors(tmp_path / "ref" / "checkpoints" / last)
    cut_state = checkpoint_tensors(tmp_path / "cut" / "checkpoints" / last)
    assert_same_state(ref_state[1], cut_state[1], "optimizer")
