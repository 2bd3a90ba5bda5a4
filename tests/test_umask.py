"""Files respect the umask (issue 30 item 8): what the atomic writers put in place gets
the permissions a plain open / mkdir would under the process umask, although
safetensors writes 0600 and `tempfile.mkdtemp` creates 0700."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from uniweave.core.atomic import apply_umask, current_umask, write_dir_atomic, write_text_atomic
from uniweave.train.state import checkpoint as ckpt


@pytest.fixture
def umask():
    def set_mask(mask: int) -> None:
        os.umask(mask)

    old = os.umask(0o022)
    yield set_mask
    os.umask(old)


def modes(root: Path) -> dict[str, int]:
    return {
        str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in [root, *root.rglob("*")]
    }


def fill(tmp: Path) -> None:
    save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))  # 0600
    (tmp / "sub").mkdir(mode=0o700)
    (tmp / "sub" / "run.sh").write_text("#!/bin/sh\n")
    os.chmod(tmp / "sub" / "run.sh", 0o700)


@pytest.mark.parametrize("unique", [False, True], ids=["staging", "mkdtemp"])
def test_written_directories_get_the_umask_permissions(tmp_path, umask, unique):
    assert current_umask() == 0o022
    out = write_dir_atomic(tmp_path, "model", fill, unique=unique)
    assert modes(out) == {".": 0o755, "model.safetensors": 0o644, "sub": 0o755, "sub/run.sh": 0o755}
    write_text_atomic(tmp_path / "eval.json", "{}\n")
    assert stat.S_IMODE((tmp_path / "eval.json").stat().st_mode) == 0o644
    umask(0o077)  # a private umask is respected too
    out = write_dir_atomic(tmp_path, "model", fill, unique=unique)
    assert set(modes(out).values()) == {0o700, 0o600}
    assert modes(out)["model.safetensors"] == 0o600 and modes(out)["sub/run.sh"] == 0o700


def test_checkpoints_get_the_umask_permissions(tmp_path, umask):
    umask(0o002)
    staging = ckpt.staging_dir(tmp_path, 3)
    ckpt.write_rank_rng(staging, 0)
    opt = {"optimizer": {}, "scheduler": {}}
    final = ckpt.commit_checkpoint(tmp_path, 3, {"w": torch.ones(2)}, opt, {}, keep_last=0)
    assert modes(final) == {
        ".": 0o775,
        "model.safetensors": 0o664,
        "optimizer.pt": 0o664,
        "rng-rank0.pt": 0o664,
        "state.json": 0o664,
    }
    assert ckpt.verify_checkpoint(final).update == 3


def test_apply_umask_leaves_links_alone(tmp_path, umask):
    target = tmp_path / "t"
    target.write_text("x")
    os.chmod(target, 0o600)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "link").symlink_to(target)
    apply_umask(tmp_path / "d")
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
