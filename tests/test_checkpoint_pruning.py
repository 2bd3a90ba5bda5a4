"""Pruning keeps what can be resumed; interrupted writes leave nothing behind.

`keep_last` counts verified checkpoints only (corrupt ones go to checkpoints/corrupt/),
a pruned checkpoint is renamed before it is deleted, and the temporaries of interrupted
writes (checkpoint staging, half-pruned checkpoints, the final model, config records)
are removed at the next start with a log line.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from trainer_helpers import run_cli, tiny_config, write_config

from uniweave.train.state import checkpoint as ckpt


@pytest.fixture(scope="module")
def codec_dir(small_vq_dir):
    return small_vq_dir


def _commit(run_dir: Path, update: int, keep_last: int) -> Path:
    state = {"w": torch.full((3,), float(update))}
    return ckpt.commit_checkpoint(run_dir, update, state, {"step": update}, {}, keep_last)


def _corrupt(path: Path) -> None:
    weights = path / ckpt.MODEL
    weights.write_bytes(weights.read_bytes()[:-4])


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def test_keep_last_counts_verified_checkpoints_and_moves_corrupt_ones_aside(tmp_path):
    for update in (1, 2, 3, 4):
        _commit(tmp_path, update, keep_last=0)
    for update in (3, 4):
        _corrupt(tmp_path / "checkpoints" / f"update-{update:06d}")
    with pytest.warns(UserWarning, match="moved corrupt checkpoint aside"):
        _commit(tmp_path, 5, keep_last=2)
    root = tmp_path / "checkpoints"
    assert _names(root) == ["corrupt", "update-000002", "update-000005"]
    assert _names(root / "corrupt") == ["update-000003", "update-000004"]
    assert ckpt.latest_checkpoint(tmp_path).update == 5
    assert load_file(str(root / "update-000002" / ckpt.MODEL))["w"][0] == 2.0


def test_stale_temporaries_and_half_pruned_checkpoints_are_removed_with_a_log_line(
    tmp_path, caplog
):
    _commit(tmp_path, 1, keep_last=0)
    root = tmp_path / "checkpoints"
    (root / ".tmp-update-000002").mkdir()
    (root / ".prune-update-000000").mkdir()
    (root / ".prune-update-000000" / "optimizer.pt").write_bytes(b"x")
    (tmp_path / ".model.tmp-new").mkdir()
    (tmp_path / ".config.yaml.tmp").write_text("half")
    (tmp_path / ".tokenizer.tmp-abc").mkdir()
    with caplog.at_level(logging.WARNING, logger="uniweave.train.state.checkpoint"):
        removed = ckpt.tidy_run_dir(tmp_path)
    assert len(removed) == 5
    assert _names(root) == ["update-000001"]
    assert _names(tmp_path) == ["checkpoints"]
    assert sum("left by an interrupted write" in r.message for r in caplog.records) == 5


def _updates(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["update"] for line in lines]


def test_two_corrupt_newest_checkpoints_then_a_kill_resume_from_the_newest_good_one(
    tmp_path, codec_dir
):
    """Checkpoints 0, 2, 4, 6; the newest two are corrupted. A re-run (checkpointing every
    3 updates, keeping 2) writes checkpoint 3 and is killed while writing 6: it must
    still hold checkpoints 2 and 3 (the old pruning kept the two corrupt ones and deleted
    both good ones), and the next run resumes from 3, not from update 0."""
    run_dir = tmp_path / "run"
    first = write_config(tmp_path / "a.yaml", tiny_config(run_dir, codec_dir))
    assert run_cli(["train", str(first)], {"UNIWEAVE_FAULT": "after_update:7"}).returncode == -9
    root = run_dir / "checkpoints"
    assert _names(root) == [f"update-{u:06d}" for u in (0, 2, 4, 6)]
    for update in (4, 6):
        _corrupt(root / f"update-{update:06d}")
    again = tiny_config(run_dir, codec_dir, checkpoint={"every_updates": 3, "keep_last": 2})
    second = write_config(tmp_path / "b.yaml", again)
    killed = run_cli(["train", str(second)], {"UNIWEAVE_FAULT": "checkpoint_write:6"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert "moved corrupt checkpoint aside" in killed.stderr
    assert _names(root / "corrupt") == ["update-000004", "update-000006"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ckpt.latest_checkpoint(run_dir).update == 3
    resumed = run_cli(["train", str(second)])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert _updates(run_dir) == list(range(1, 9))
    assert "removed" in resumed.stderr and ".tmp-update-000006" in resumed.stderr
    assert _names(root) == ["corrupt", "update-000006", "update-000008"]


def test_a_kill_during_the_final_model_write_leaves_no_temporary(tmp_path, codec_dir):
    run_dir = tmp_path / "run"
    cfg = tiny_config(run_dir, codec_dir, trainer={"total_updates": 2})
    path = write_config(tmp_path / "c.yaml", cfg)
    killed = run_cli(["train", str(path)], {"UNIWEAVE_FAULT": "model_write:2"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert ".model.tmp-new" in _names(run_dir) and "model" not in _names(run_dir)
    again = run_cli(["train", str(path)])
    assert again.returncode == 0, again.stderr[-2000:]
    leftovers = [p for p in run_dir.rglob("*") if ".tmp" in p.name or ".prune" in p.name]
    assert leftovers == []
    assert "left by an interrupted write" in again.stderr
    assert (run_dir / "model" / "model.safetensors").is_file()
    assert _updates(run_dir) == [1, 2]
