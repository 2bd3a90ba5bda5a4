"""Atomic checkpoints with exact resume (docs/architecture.md §5).

A checkpoint is a directory ``checkpoints/update-NNNNNN`` holding the model weights
(safetensors; LoRA adapters alone when LoRA is on), optimizer and scheduler state (under
ddp/fsdp2 instead: ``dcp/``, torch.distributed.checkpoint shards written by every rank,
`uniweave.train.state.sharded`), per-rank RNG states and ``state.json`` (update counter, data cursor, config hash, the world
size that wrote it and the execution changes met by earlier resumes, and a manifest of
every file's size and SHA-256). It is written under a temporary name, every file and the
directory are fsynced, and only then is it renamed into place; a directory without a
valid manifest is never considered complete.

Pruning keeps what can be resumed: `keep_last` counts verified checkpoints only, newest
first; a corrupt one is moved aside to ``checkpoints/corrupt/`` with a warning (never
counted, never the reason a good one is deleted), and a pruned checkpoint is first renamed
``.prune-update-NNNNNN`` and then deleted, so a kill mid-delete leaves a name that
`tidy_run_dir` removes at the next start, with the staging directories of interrupted
checkpoint writes and the temporaries of interrupted atomic file and directory writes
(`uniweave.core.atomic`: `write_dir_atomic`, `write_text_atomic`, re-exported here).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from uniweave.config.fingerprint import file_sha256
from uniweave.core.atomic import apply_umask, fsync_dir, fsync_tree, is_temporary, remove
from uniweave.core.atomic import write_dir_atomic as write_dir_atomic  # re-exported
from uniweave.core.atomic import write_text_atomic as write_text_atomic  # re-exported
from uniweave.train.state.artifacts import ROLLOUTS, read_best, write_best

STATE = "state.json"
MODEL = "model.safetensors"
OPTIMIZER = "optimizer.pt"
DCP = "dcp"
PREFIX = "update-"
STAGING = ".tmp-"
PRUNING = ".prune-"
CORRUPT = "corrupt"

logger = logging.getLogger(__name__)
# Checkpoints this process verified or wrote, with the (name, size, mtime) of their files:
# unchanged files are not hashed again when pruning.
_verified: dict[str, tuple] = {}


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

    @property
    def sharded(self) -> bool:
        """Written by torch.distributed.checkpoint (``dcp/``: trainer.parallel ddp/fsdp2)."""
        return (self.path / DCP).is_dir()

    def rng_state(self, rank: int) -> dict[str, Any]:
        return torch.load(self.path / f"rng-rank{rank}.pt", weights_only=False)


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
    return checkpoint_dir(run_dir) / f"{STAGING}{PREFIX}{update:06d}"


def write_rank_rng(staging: Path, rank: int) -> None:
    staging.mkdir(parents=True, exist_ok=True)
    torch.save(rng_states(), staging / f"rng-rank{rank}.pt")


def _unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies of `state` in which no two entries share storage (tied
    weights are stored once per name, as safetensors requires)."""
    seen: set[int] = set()
    out = {}
    for name, value in state.items():
        tensor = value.detach().contiguous().cpu()
        pointer = tensor.untyped_storage().data_ptr()
        if pointer in seen:
            tensor = tensor.clone()
        seen.add(pointer)
        out[name] = tensor
    return out


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
    save_file(_unshared(model_state), str(staging / MODEL))
    torch.save(optimizer_state, staging / OPTIMIZER)
    return seal_checkpoint(run_dir, update, state, keep_last)


def seal_checkpoint(run_dir: Path, update: int, state: dict[str, Any], keep_last: int) -> Path:
    """Make the staging directory of `update` a checkpoint (rank 0, after every rank
    wrote its part): manifest every file under it (relative path, size, SHA-256), fsync,
    write ``state.json``, rename into place, prune."""
    staging = staging_dir(run_dir, update)
    files = sorted(
        str(p.relative_to(staging)) for p in staging.rglob("*") if p.is_file() and p.name != STATE
    )
    manifest = {
        name: {"size": (staging / name).stat().st_size, "sha256": file_sha256(staging / name)}
        for name in files
    }
    full_state = {**state, "update": update, "manifest": manifest}
    (staging / STATE).write_text(json.dumps(full_state, indent=2, sort_keys=True))
    apply_umask(staging)
    fsync_tree(staging)
    final = checkpoint_dir(run_dir) / f"{PREFIX}{update:06d}"
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)
    fsync_dir(final.parent)
    _verified[str(final)] = _signature(final)
    if state.get("best") is not None:  # checkpoint.keep_best: the record, before pruning
        write_best(checkpoint_dir(run_dir), state["best"])
    prune(run_dir, keep_last)
    return final


def prune(run_dir: Path, keep_last: int) -> None:
    """Keep the `keep_last` newest *verified* checkpoints (0 = all); move corrupt ones
    met on the way to ``checkpoints/corrupt/``; delete older ones (rename, then remove),
    except the best checkpoint ``checkpoints/best.json`` names (`checkpoint.keep_best`)."""
    if keep_last <= 0:
        return
    kept = 0
    best = read_best(checkpoint_dir(run_dir))
    protected = best.get("checkpoint") if best else None
    for path in reversed(_candidates(run_dir)):
        if kept >= keep_last:
            if path.name != protected:
                _remove(path)
            continue
        try:
            verify_checkpoint(path)
        except CheckpointError as exc:
            move_aside(path, str(exc))
            continue
        kept += 1


def _remove(path: Path) -> None:
    doomed = path.with_name(PRUNING + path.name)
    os.replace(path, doomed)
    _verified.pop(str(path), None)
    shutil.rmtree(doomed)


def move_aside(path: Path, reason: str) -> Path:
    """Move the corrupt checkpoint `path` to ``checkpoints/corrupt/`` (warns; returns
    where it went; a name already there gets a ``-N`` suffix)."""
    root = path.parent / CORRUPT
    root.mkdir(exist_ok=True)
    dest, n = root / path.name, 1
    while dest.exists():
        dest, n = root / f"{path.name}-{n}", n + 1
    os.replace(path, dest)
    _verified.pop(str(path), None)
    warnings.warn(f"moved corrupt checkpoint aside to {dest}: {reason}", stacklevel=2)
    return dest


def _candidates(run_dir: Path) -> list[Path]:
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    paths = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX)]
    return sorted(paths, key=lambda p: p.name)


def _signature(path: Path) -> tuple:
    return tuple(
        sorted(
            (str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns)
            for p in path.rglob("*")
            if p.is_file()
        )
    )


def verify_checkpoint(path: Path) -> Checkpoint:
    """Check the manifest of `path` (sizes and hashes); raise CheckpointError if not intact."""
    state_file = path / STATE
    try:
        state = json.loads(state_file.read_text())
        manifest = state["manifest"]
        update = int(state["update"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: unreadable {STATE} ({exc})") from exc
    if _verified.get(str(path)) == _signature(path):
        return Checkpoint(path=path, update=update, state=state)
    for name, entry in manifest.items():
        file = path / name
        if not file.is_file() or file.stat().st_size != entry["size"]:
            raise CheckpointError(f"{path}: {name} is missing or truncated")
        if file_sha256(file) != entry["sha256"]:
            raise CheckpointError(f"{path}: {name} fails its checksum")
    _verified[str(path)] = _signature(path)
    return Checkpoint(path=path, update=update, state=state)


@dataclass
class Scan:
    """A read-only look at a run's checkpoints: the newest intact one, the corrupt ones
    newer than it (path, reason), and how many checkpoint directories there are."""

    latest: Checkpoint | None
    corrupt: list[tuple[Path, str]]
    n_candidates: int


def scan_checkpoints(run_dir: Path) -> Scan:
    """Verify checkpoints newest first until one is intact; changes nothing on disk."""
    candidates = _candidates(run_dir)
    corrupt: list[tuple[Path, str]] = []
    for path in reversed(candidates):
        try:
            return Scan(verify_checkpoint(path), corrupt, len(candidates))
        except CheckpointError as exc:
            corrupt.append((path, str(exc)))
    return Scan(None, corrupt, len(candidates))


def latest_checkpoint(run_dir: Path) -> Checkpoint | None:
    """The newest intact checkpoint of a run; corrupt ones are skipped with a warning."""
    scan = scan_checkpoints(run_dir)
    for _path, reason in scan.corrupt:
        warnings.warn(f"skipping corrupt checkpoint: {reason}", stacklevel=2)
    return scan.latest


def last_saved(run_dir: Path) -> Path | None:
    """The newest committed checkpoint directory of a run, by name, without verifying it
    (what an interrupted run reports having saved); None when there is none."""
    found = _candidates(run_dir)
    return found[-1] if found else None


def stale_temporaries(run_dir: Path) -> list[Path]:
    """What interrupted writes leave behind: checkpoint staging directories, half-pruned
    checkpoints, and the temporaries of atomic writes in the run directory, its
    checkpoints/ (best.json) and rollouts/ (saved rollouts)."""
    run_dir = Path(run_dir)
    found = [p for p in run_dir.iterdir() if is_temporary(p)] if run_dir.is_dir() else []
    root = checkpoint_dir(run_dir)
    if root.is_dir():
        found += [
            p for p in root.iterdir() if p.name.startswith((STAGING, PRUNING)) or is_temporary(p)
        ]
    rollouts = run_dir / ROLLOUTS
    if rollouts.is_dir():  # checkpoint.save_rollouts
        found += [p for p in rollouts.iterdir() if is_temporary(p)]
    return sorted(found)


def tidy_run_dir(run_dir: Path, scan: Scan | None = None) -> list[Path]:
    """At the start of a run (rank 0, after the resume check accepted it): remove stale
    temporaries and move aside the corrupt checkpoints newer than the one resumed, with
    a log line each. Returns what was removed."""
    removed = stale_temporaries(run_dir)
    for path in removed:
        remove(path)
        logger.warning("removed %s (left by an interrupted write)", path)
    for path, reason in scan.corrupt if scan is not None else []:
        if path.is_dir():
            move_aside(path, reason)
    return removed


def clear_staging(run_dir: Path) -> None:
    """Remove temporary directories left by a checkpoint write that was interrupted."""
    root = checkpoint_dir(run_dir)
    if root.is_dir():
        for path in root.iterdir():
            if path.name.startswith(STAGING):
                shutil.rmtree(path, ignore_errors=True)
