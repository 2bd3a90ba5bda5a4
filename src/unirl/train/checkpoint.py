"""Atomic checkpoints with exact resume (DESIGN.md §5).

A checkpoint is a directory ``checkpoints/update-NNNNNN`` holding the model weights
(safetensors; LoRA adapters alone when LoRA is on), optimizer and scheduler state, per-rank
RNG states and ``state.json`` (update counter, data cursor, config hash and a manifest of
every file's size and SHA-256). It is written under a temporary name, every file and the
directory are fsynced, and only then is it renamed into place; a directory without a
valid manifest is never considered complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

STATE = "state.json"
MODEL = "model.safetensors"
OPTIMIZER = "optimizer.pt"
PREFIX = "update-"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used (corrupt, incomplete or from another config)."""


@dataclass
class Checkpoint:
    path: Path
    update: int
    state: dict[str, Any]

    def model_state(self) -> dict[str, torch.Tensor]:
        return load_file(str(self.path / MODEL))

    def optimizer_state(self) -> dict[str, Any]:
        return torch.load(self.path / OPTIMIZER, weights_only=False)

    def rng_state(self, rank: int) -> dict[str, Any]:
        return torch.load(self.path / f"rng-rank{rank}.pt", weights_only=False)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def rng_states() -> dict[str, Any]:
    """This process's RNG states (torch CPU, CUDA if present)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_states(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def staging_dir(run_dir: Path, update: int) -> Path:
    """The temporary directory every rank writes its part of checkpoint `update` into."""
    return checkpoint_dir(run_dir) / f".tmp-{PREFIX}{update:06d}"


def write_rank_rng(staging: Path, rank: int) -> None:
    staging.mkdir(parents=True, exist_ok=True)
    torch.save(rng_states(), staging / f"rng-rank{rank}.pt")


def commit_checkpoint(
    run_dir: Path,
    update: int,
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
    state: dict[str, Any],
    keep_last: int,
) -> Path:
    """Write model + optimizer + state into the staging directory, fsync, rename (rank 0).

    Per-rank RNG files must already be in the staging directory (`write_rank_rng`).
    """
    staging = staging_dir(run_dir, update)
    staging.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.detach().contiguous().cpu() for k, v in model_state.items()}, str(staging / MODEL)
    )
    torch.save(optimizer_state, staging / OPTIMIZER)
    files = sorted(p.name for p in staging.iterdir() if p.name != STATE)
    manifest = {}
    for name in files:
        _fsync_file(staging / name)
        manifest[name] = {
            "size": (staging / name).stat().st_size,
            "sha256": _sha256(staging / name),
        }
    full_state = {**state, "update": update, "manifest": manifest}
    state_tmp = staging / STATE
    state_tmp.write_text(json.dumps(full_state, indent=2, sort_keys=True))
    _fsync_file(state_tmp)
    _fsync_dir(staging)
    final = checkpoint_dir(run_dir) / f"{PREFIX}{update:06d}"
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)
    _fsync_dir(final.parent)
    _prune(run_dir, keep_last)
    return final


def _prune(run_dir: Path, keep_last: int) -> None:
    if keep_last <= 0:
        return
    complete = [c for c in _candidates(run_dir)]
    for path in complete[:-keep_last]:
        shutil.rmtree(path, ignore_errors=True)


def _candidates(run_dir: Path) -> list[Path]:
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    paths = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX)]
    return sorted(paths, key=lambda p: p.name)


def verify_checkpoint(path: Path) -> Checkpoint:
    """Check the manifest of `path` (sizes and hashes); raise CheckpointError if not intact."""
    state_file = path / STATE
    try:
        state = json.loads(state_file.read_text())
        manifest = state["manifest"]
        update = int(state["update"])
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{path}: unreadable {STATE} ({exc})") from exc
    for name, entry in manifest.items():
        file = path / name
        if not file.is_file() or file.stat().st_size != entry["size"]:
            raise CheckpointError(f"{path}: {name} is missing or truncated")
        if _sha256(file) != entry["sha256"]:
            raise CheckpointError(f"{path}: {name} fails its checksum")
    return Checkpoint(path=path, update=update, state=state)


def latest_checkpoint(run_dir: Path) -> Checkpoint | None:
    """The newest intact checkpoint of a run; corrupt ones are skipped with a warning."""
    for path in reversed(_candidates(run_dir)):
        try:
            return verify_checkpoint(path)
        except CheckpointError as exc:
            warnings.warn(f"skipping corrupt checkpoint: {exc}", stacklevel=2)
    return None


def clear_staging(run_dir: Path) -> None:
    """Remove temporary directories left by a checkpoint write that was interrupted."""
    root = checkpoint_dir(run_dir)
    if root.is_dir():
        for path in root.iterdir():
            if path.name.startswith(".tmp-"):
                shutil.rmtree(path, ignore_errors=True)
